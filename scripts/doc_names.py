"""The names a page gives exist, and "above" and "below" point the right way (check_docs --lint).

Static: the repository's Python files are parsed (``ast``), never imported, and nothing runs.

- A path in backticks or in a link (``scaletorch/parallel/zero.py``, ``doc/01_ddp.md``) is a
  file or folder of the repository; a bare file name (``zero.py``) is one somewhere in it.
- A dotted name (``pipeline_schedules.PipelineRank``, ``pgm.gradient_sync_group``,
  ``parallel.impl``) whose first part is one of our modules, classes, ``pgm`` or a config
  section resolves part by part: a module's top-level name, then a class's attribute. A bare
  ``Name`` in CamelCase, or a ``name(...)`` call, is defined in the repository or is one of
  PyTorch's names listed in EXTERNAL.
- A flag in prose (```--impl```) is accepted by some script; a flag in a command is accepted
  by the script it is given to (its own ``add_argument`` calls, those of the modules it
  imports, and the config's flags and ``--section.field`` overrides if it loads a config).
  ``scripts/launch.sh``'s own options are read from its ``case`` lines.
- "the picture (table, block, output...) above" finds one before the sentence in its section
  (between the ``#`` or ``##`` headings around it), "below" one after it. A reference to
  another section names it.
"""

import ast
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", "runs", "__pycache__", ".mypy_cache", ".eggs"}
FILE_EXTENSIONS = (".py", ".md", ".yaml", ".sh", ".txt", ".cfg", ".sbatch", ".json", ".toml")
# PyTorch's (and Python's) names the pages name beside ours: not ours to resolve.
EXTERNAL = set("""
    AdamW AutoTokenizer BatchNorm2d ColwiseParallel DTensor DataLoader DeviceMesh
    DistBackendError DistributedDataParallel FileNotFoundError FileSystemReader FileSystemWriter
    FlopCounterMode FullyShardedDataParallel GPipe GradScaler KeyError KeyboardInterrupt
    LayerNorm LlamaForCausalLM MixedPrecisionPolicy ModuleList OutOfMemoryError Partial
    PipelineStage PrepareModuleInput ProcessGroup Replicate RowwiseParallel RuntimeError SIGINT
    SIGKILL SIGTERM Schedule1F1B ScheduleDualPipeV ScheduleGPipe ScheduleInterleaved1F1B
    ScheduleInterleavedZeroBubble ScheduleZBVZeroBubble SequenceParallel Shard StateDict
    SyncBatchNorm TorchElastic TypeError ValueError WeightGradStore Work abs all_gather
    all_gather_into_tensor all_reduce all_to_all_single autocast backward barrier
    batch_isend_irecv broadcast cat checkpoint chunk clip_grad_norm_ compile context_parallel
    cross_entropy destroy_process_group distribute_tensor empty export flex_attention float
    forward from_local full_tensor fully_shard get_rank getattr init_device_mesh
    init_process_group int irecv isend isinstance len load load_state_dict logsumexp
    loss_parallel main manual_seed max max_memory_allocated memory_allocated min
    monitored_barrier new_group no_sync open parallelize_module parameters perf_counter pipeline
    print profile range record_function recv redistribute reduce_scatter reduce_scatter_tensor
    register_forward_hook register_forward_pre_hook register_full_backward_hook register_hook
    register_post_accumulate_grad_hook replicate save scaled_dot_product_attention schedule send
    set_seed setattr sleep softmax sorted split_module state_dict step sum tensor_split time
    to_local wait zero_grad zeros
""".split())
# Modules of Python and PyTorch whose names a page may give as ``time.perf_counter``.
NOT_OURS = {
    "time", "os", "sys", "math", "json", "random", "signal", "torch", "dist", "nn", "F", "np",
    "numpy", "yaml", "typing", "functools", "transformers", "safetensors"
}
# A bare file name a page gives is one of ours with these endings; others (config.json,
# log.txt, manifest.json) are files a run or a download writes.
OUR_FILES = (".py", ".md", ".sh")
FLAG = re.compile(r"^--[a-z][\w-]*$")
PROSE_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*(?:\.[a-z_][\w.]*)?)")
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
CALL = re.compile(r"^([A-Za-z_]\w*)\(.*\)$")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
SECTIONS = ("model", "data", "parallel", "training", "checkpoint", "logging", "vision")


def _config_error(parts: List[str]) -> Optional[str]:
    """``_resolve_in_class`` for a config key: ``vision`` is chapter 12's section of its own
    (``VisionRunConfig``'s), the others are every Config's."""
    if parts[0] == "vision":
        return _resolve_in_class("VisionConfig", parts[1:])
    return _resolve_in_class("Config", parts)


DIRECTION = re.compile(
    r"\b(picture|figure|diagram|drawing|chart|table|block|output|excerpt|code|listing|loop|"
    r"timeline|command)s?\s+(above|below)\b", re.IGNORECASE)
PICTURE = ("picture", "figure", "diagram", "drawing", "chart", "timeline")


@dataclass
class ClassInfo:
    attrs: Set[str] = field(default_factory=set)
    bases: List[str] = field(default_factory=list)
    field_types: Dict[str, str] = field(default_factory=dict)  # annotated name -> type name


@dataclass
class ModuleInfo:
    path: str
    names: Set[str] = field(default_factory=set)  # top-level defs, assignments, imports
    classes: Dict[str, ClassInfo] = field(default_factory=dict)
    flags: Set[str] = field(default_factory=set)  # add_argument("--x") and dict keys "--x"
    imports: Set[str] = field(default_factory=set)  # dotted modules it imports from


@dataclass
class Index:
    files: Set[str]  # relative paths, folders too (with a trailing "/")
    basenames: Set[str]
    modules: Dict[str, ModuleInfo]  # dotted name -> info
    classes: Dict[str, List[ClassInfo]]
    defined: Set[str]  # every function, method and class name
    config_flags: Set[str]
    launcher_flags: Set[str]


def _type_name(node: Optional[ast.expr]) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):  # Optional[X]
        return _type_name(node.slice)
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _module_info(rel: str, tree: ast.Module) -> ModuleInfo:
    info = ModuleInfo(rel)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        info.names.add(name.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                info.names.add((alias.asname or alias.name).split(".")[0])
        if isinstance(node, ast.ClassDef):
            cls = ClassInfo(bases=[_type_name(b) for b in node.bases])
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    cls.attrs.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    cls.attrs.add(item.target.id)
                    cls.field_types[item.target.id] = _type_name(item.annotation)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    cls.attrs.add(item.attr)  # self.x = ...
                elif isinstance(item, ast.Assign):
                    cls.attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
            info.classes[node.name] = cls
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                isinstance(node.left.value, str) and FLAG.match(node.left.value):
            info.flags.add(node.left.value)  # "--show-schedule" in argv
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            info.imports.add(node.module)
            info.imports.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            info.imports.update(a.name for a in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "add_argument":
            info.flags.update(a.value for a in node.args if isinstance(a, ast.Constant)
                              and isinstance(a.value, str) and a.value.startswith("-"))
        elif isinstance(node, ast.Dict):  # ALIASES = {"--steps": ...}
            info.flags.update(k.value for k in node.keys if isinstance(k, ast.Constant)
                              and isinstance(k.value, str) and k.value.startswith("--"))
    return info


@lru_cache(maxsize=1)
def index() -> Index:
    """Every file of the repository and every Python file's names, parsed once."""
    files, modules = set(), {}
    for top, dirs, names in os.walk(ROOT):
        if "pyvenv.cfg" in names:  # a virtual environment in the checkout (CI's .venv): not ours
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        rel_top = os.path.relpath(top, ROOT)
        if rel_top != ".":
            files.add(rel_top.replace(os.sep, "/") + "/")
        for name in names:
            rel = os.path.normpath(os.path.join(rel_top, name)).replace(os.sep, "/")
            files.add(rel)
            if name.endswith(".py"):
                with open(os.path.join(top, name), encoding="utf-8") as f:
                    try:
                        tree = ast.parse(f.read())
                    except SyntaxError:
                        continue
                dotted = rel[:-3].replace("/", ".")
                dotted = dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted
                modules[dotted] = _module_info(rel, tree)
    classes: Dict[str, List[ClassInfo]] = {}
    defined: Set[str] = set()
    for info in modules.values():
        for name, cls in info.classes.items():
            classes.setdefault(name, []).append(cls)
            defined.add(name)
            defined.update(cls.attrs)
        defined.update(info.names)
    config = modules.get("scaletorch.trainer.config", ModuleInfo(""))
    config_flags = set(config.flags) | {"--validate-only", "--world-size", "--help", "-h"}
    launcher = set()
    with open(os.path.join(ROOT, "scripts", "launch.sh"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^\s*((?:-{1,2}[\w-]+\|?)+)\)", line)
            if m:
                launcher.update(m.group(1).split("|"))
    return Index(files, {os.path.basename(f.rstrip("/"))
                         for f in files}, modules, classes, defined, config_flags, launcher)


# --- names ------------------------------------------------------------------------------------


def _class_attrs(name: str, seen: Optional[Set[str]] = None) -> Optional[Set[str]]:
    """Every attribute of the classes called ``name`` and their bases (ours), or None."""
    idx, seen = index(), seen or set()
    if name not in idx.classes or name in seen:
        return None
    seen.add(name)
    attrs: Set[str] = set()
    for cls in idx.classes[name]:
        attrs |= cls.attrs
        for base in cls.bases:
            attrs |= _class_attrs(base, seen) or set()
    return attrs


def _field_type(class_name: str, attr: str) -> str:
    for cls in index().classes.get(class_name, []):
        if attr in cls.field_types:
            return cls.field_types[attr]
    return ""


def _module(parts: List[str]) -> Tuple[Optional[str], int]:
    """The longest prefix of ``parts`` that names one of our modules (dotted in full, or its
    last parts: ``pipeline_schedules``, ``parallel.step``), and how many parts it took."""
    modules = index().modules
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix, n
        found = [m for m in modules if m.endswith("." + prefix)]
        if len(found) == 1:
            return found[0], n
    return None, 0


def _resolve_in_class(cls: str, rest: List[str]) -> Optional[str]:
    """Walk ``rest`` through class ``cls``'s attributes (a config field's type goes on)."""
    for i, part in enumerate(rest):
        attrs = _class_attrs(cls)
        if attrs is None:
            return None  # not ours (a torch type): nothing more to say
        if part not in attrs:
            return f"{cls} has no attribute '{part}'"
        cls = _field_type(cls, part)
        if not cls:
            return None
    return None


def dotted_error(name: str) -> Optional[str]:
    """Why the dotted ``name`` names nothing of ours, or None (it resolves, or is not ours)."""
    parts = name.split(".")
    if parts[0] == "pgm":
        return _resolve_in_class("ProcessGroupManager", parts[1:])
    if parts[0] == "cfg":
        return _resolve_in_class("Config", parts[1:])
    if parts[0] in NOT_OURS:
        return None
    if parts[0] in SECTIONS:  # a config field (parallel.impl), else a module (parallel.step)
        error = _config_error(parts[:2])
        if error is None:
            return None
        module, n = _module(parts)
        if module is not None and n >= 2:  # parallel.step, not model.timeline (a model's)
            return dotted_error_in_module(parts)
        return error if len(parts) == 2 and parts[0] != "model" else None
    return dotted_error_in_module(parts)


def dotted_error_in_module(parts: List[str]) -> Optional[str]:
    idx = index()
    module, n = _module(parts)
    if module is not None:
        rest = parts[n:]
        if not rest:
            return None
        info = idx.modules[module]
        if rest[0] not in info.names and f"{module}.{rest[0]}" not in idx.modules:
            return f"{module} defines no '{rest[0]}'"
        if rest[0] in info.classes:
            return _resolve_in_class(rest[0], rest[1:])
        return None
    if parts[0] in idx.classes:
        return _resolve_in_class(parts[0], parts[1:])
    return None


def name_errors(span: str) -> List[str]:
    """What a backticked ``span`` names that does not exist (paths, names, flags)."""
    text = span.strip()
    errors = []
    path = path_error(text)
    if path:
        return [path]
    if text.startswith("-"):
        return errors  # a flag: checked with the page's flags
    m = DOTTED.match(text)
    if m and not text.endswith(FILE_EXTENSIONS):
        error = dotted_error(m.group(1))
        return [f"`{text}`: {error}"] if error else []
    idx = index()
    m = CALL.match(text)
    name = m.group(1) if m else (text if CAMEL.match(text) else None)
    if name and name not in idx.defined and name not in EXTERNAL:
        errors.append(f"`{text}`: no function or class '{name}' in the repository")
    return errors


def _looks_like_path(text: str) -> bool:
    odd = any(c in text for c in " <>*{}$|=,:;'\"") or "..." in text
    if odd or text.startswith(("/", "~", "http", "runs/", "-", ".")):
        return False
    if "/" in text:
        return bool(re.match(r"^[\w.-]+(/[\w.-]*)+$",
                             text)) and (text.endswith("/") or text.endswith(FILE_EXTENSIONS)
                                         or "." not in text)
    return text.endswith(FILE_EXTENSIONS) and bool(re.match(r"^[\w.-]+$", text))


def path_error(text: str, base: str = "") -> Optional[str]:
    """Why the path ``text`` (from the root, or from the page's folder ``base``) is not in the
    repository, or None (it is, or it is not a path)."""
    if not _looks_like_path(text):
        return None
    idx = index()
    if "/" not in text:
        if text in idx.basenames or not text.endswith(OUR_FILES):
            return None
        return f"`{text}`: no file of that name in the repository"
    candidates = {text.rstrip("/"), os.path.normpath(os.path.join(base, text)).replace(os.sep, "/")}
    if any(c in idx.files or c + "/" in idx.files for c in candidates):
        return None
    first = text.split("/")[0]
    if first + "/" not in idx.files and first not in ("scaletorch", "doc", "examples", "scripts",
                                                      "tests"):
        return None  # a path outside the repository (a user's DIR/, torch/...)
    return f"`{text}`: no such file in the repository"


# --- flags ------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def script_flags(script: str) -> Optional[Set[str]]:
    """The flags ``script`` (a path from the root) accepts, or None if it is not ours."""
    idx = index()
    dotted = script[:-3].replace("/", ".") if script.endswith(".py") else ""
    if dotted not in idx.modules:
        return None
    info = idx.modules[dotted]
    flags = set(info.flags) | {"--help", "-h"}
    for module in info.imports:
        if module in idx.modules and module.startswith(("scaletorch", "scripts")):
            flags |= idx.modules[module].flags
    if any(m.startswith("scaletorch.trainer")
           for m in info.imports) and ("load_config" in info.names or "parse_args" in info.names):
        flags |= idx.config_flags | {"--section.field"}
    return flags


def config_field_error(flag: str) -> Optional[str]:
    """Why ``--section.field`` is no config field, or None."""
    parts = flag[2:].split(".")
    if parts[0] not in SECTIONS:
        return f"{flag}: no config section '{parts[0]}' (sections: {', '.join(SECTIONS)})"
    error = _config_error(parts)
    return f"{flag}: {error}" if error else None


def all_flags() -> Set[str]:
    idx = index()
    flags = set(idx.config_flags) | idx.launcher_flags | {"--section.field"}
    for info in idx.modules.values():
        flags |= info.flags
    return flags


@lru_cache(maxsize=1)
def impl_table() -> Dict[str, Set[str]]:
    """{script: the ``--impl`` values it accepts}, from doc/glossary.md's table (the one list;
    tests/test_impl_table.py holds each script to it)."""
    with open(os.path.join(ROOT, "doc", "glossary.md"), encoding="utf-8") as f:
        text = f.read()
    rows = re.finditer(r"^\| `(\d\d[a-z]?_\w+)` \| ([a-z, ]+) \|", text, re.MULTILINE)
    return {m.group(1): {v.strip() for v in m.group(2).split(",")} for m in rows}


def impl_error(script: str, words: List[str]) -> Optional[str]:
    """Why ``--impl V`` among a script's ``words`` is a value the script refuses, or None."""
    name = os.path.basename(script)[:-3]
    accepted = impl_table().get(name)
    for flag, value in zip(words, words[1:]):
        if flag == "--impl" and accepted is not None and value not in accepted:
            return f"--impl {value}: {name} accepts {', '.join(sorted(accepted))} (glossary)"
    return None


def flag_error(flag: str, accepted: Optional[Set[str]], given_to: str) -> Optional[str]:
    """Why ``flag`` is not accepted (by ``given_to``'s flags ``accepted``), or None."""
    if "." in flag:
        if accepted is not None and "--section.field" not in accepted:
            return f"{flag}: {given_to} loads no config (no --section.field overrides)"
        return config_field_error(flag)
    if accepted is None or flag in accepted:
        return None
    return f"{flag}: not a flag of {given_to}"


def command_errors(command: str) -> List[str]:
    """The flags of one shell command that its script does not accept."""
    try:
        words = [w for w in shlex.split(command, comments=True) if " " not in w]
    except ValueError:  # an unbalanced quote: the words as they stand
        words = command.split()
    errors = []
    for i, word in enumerate(words):
        if word == "scripts/launch.sh" and i + 1 < len(words):
            script = words[i + 1]
            rest = words[i + 2:]
            cut = rest.index("--") if "--" in rest else len(rest)
            for w in rest[:cut]:
                if w.startswith("--"):
                    error = flag_error(w.split("=")[0], index().launcher_flags, "scripts/launch.sh")
                    errors += [error] if error else []
            flags = script_flags(script)
            error = impl_error(script, rest[cut + 1:])
            errors += [error] if error else []
            for w in rest[cut + 1:]:
                if w.startswith("--") and len(w) > 2:
                    error = flag_error(w.split("=")[0], flags, script)
                    errors += [error] if error else []
            break
        if word in ("python", "python3") and i + 1 < len(words) and words[i + 1].endswith(".py"):
            script = words[i + 1]
            flags = script_flags(script)
            for w in words[i + 2:]:
                if w in ("|", ">", "&&", ";", "2>&1"):
                    break
                if w.startswith("--") and len(w) > 2:
                    error = flag_error(w.split("=")[0], flags, script)
                    errors += [error] if error else []
            break
    return errors


# --- above and below --------------------------------------------------------------------------


def _elements(lines: List[str]) -> List[Tuple[int, str]]:
    """(line, kind) of each fence ("block"), image ("picture") and table ("table")."""
    out, in_fence = [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("```"):
            if not in_fence:
                out.append((i, "block"))
            in_fence = not in_fence
        elif in_fence:
            continue
        elif stripped.startswith("!["):
            out.append((i, "picture"))
        elif stripped.startswith("|") and (i == 0 or not lines[i - 1].strip().startswith("|")):
            out.append((i, "table"))
    return out


def direction_errors(rel: str, text: str) -> List[str]:
    """References to something above that is not above (or below that is not below) in the
    same section. A picture may be an image or a drawn (fenced) one; a table may be a fenced
    output table; anything else is a fenced block."""
    lines = text.splitlines()
    elements = _elements(lines)
    headings = [i for i, line in enumerate(lines) if re.match(r"^#{1,2} ", line)]
    fenced = {i for i, _ in elements}
    errors = []
    in_fence = False
    for number, line in enumerate(lines):
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or number in fenced:
            continue
        for m in DIRECTION.finditer(line):
            noun, way = m.group(1).lower(), m.group(2).lower()
            start = max([h for h in headings if h <= number], default=-1)
            end = min([h for h in headings if h > number], default=len(lines))
            kinds = {"block"} | ({"picture"} if noun in PICTURE else
                                 set()) | ({"table"} if noun == "table" else set())
            if way == "above":
                found = any(start < i < number and k in kinds for i, k in elements)
            else:
                found = any(number < i < end and k in kinds for i, k in elements)
            if not found:
                errors.append(f"{rel}:{number + 1}: '{m.group(0)}' but no {noun} {way} it in its "
                              f"section")
    return errors


def page_errors(path: str, text: Optional[str] = None) -> List[str]:
    """Every name, flag and direction of one page that does not hold, with its line."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    rel = os.path.relpath(path, ROOT)
    base = os.path.dirname(rel)
    errors, in_fence, fence_info = [], False, ""
    prose_flags = all_flags()
    block: List[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if in_fence and fence_info == "bash":
                errors += [
                    f"{rel}:{number}: {e}" for c in _joined(block) for e in command_errors(c)
                ]
            in_fence, fence_info, block = not in_fence, stripped[3:].strip(), []
            continue
        if in_fence:
            block.append(line)
            continue
        for m in LINK.finditer(line):
            target = m.group(1)
            if not target.startswith(("http", "mailto")):
                full = os.path.normpath(os.path.join(base, target)).replace(os.sep, "/")
                if full not in index().files and full + "/" not in index().files:
                    errors.append(f"{rel}:{number}: link to {target}: no such file")
        for m in SPAN.finditer(line):
            span = m.group(1)
            error = path_error(span.strip(), base)
            errors += [f"{rel}:{number}: {error}"
                       ] if error else [f"{rel}:{number}: {e}" for e in name_errors(span)]
            first = span.strip().split()[0] if span.strip() else ""
            command = span.strip().startswith(("scripts/launch.sh", "python "))
            for flag in PROSE_FLAG.findall(span):
                if command or not first.startswith("-"):
                    continue  # a command: ours checked below, another tool's not ours to check
                error = flag_error(flag, prose_flags, "any script")
                errors += [f"{rel}:{number}: {error}"] if error else []
            if span.strip().startswith(("scripts/launch.sh", "python ")):
                errors += [f"{rel}:{number}: {e}" for e in command_errors(span.strip())]
    return errors + direction_errors(rel, text)


def _joined(lines: List[str]) -> List[str]:
    out, current = [], ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#") and not current:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        out.append((current + stripped).split(" #")[0])
        current = ""
    return out


if __name__ == "__main__":  # a module: one line saying what to run instead, exit 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scripts import module_only

    module_only(__doc__, "python scripts/check_docs.py --lint")
