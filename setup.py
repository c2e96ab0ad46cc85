from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="scaletorch",
    version="0.1.0",
    description="Distributed training of transformer language models, one strategy at a time",
    packages=find_packages(include=["scaletorch", "scaletorch.*"]),
    python_requires=">=3.10",
    install_requires=requirements,
    extras_require={
        # types-*: stubs of the runtime requirements (pyyaml, tqdm) that mypy checks against;
        # beartype: the run-time checker of the jaxtyping shapes in the tests; hypothesis: the
        # property-based tests that generate bad inputs, models and solutions
        "dev": [
            "pytest", "flake8", "flake8-quotes", "yapf", "isort", "mypy", "pre-commit",
            "pre-commit-hooks", "types-PyYAML", "types-tqdm", "beartype", "hypothesis"
        ],
        "plot": ["matplotlib"],
        # Hugging Face checkpoints (safetensors), tokenizer.json files (tokenizers); transformers
        # only for the comparison tests and doc/10's cross-check.
        "hf": ["safetensors", "tokenizers", "transformers"],
        # chapter 12's image folders (JPEG, PNG, PPM, ...); synthetic images need nothing
        "vision": ["pillow"],
    },
)
