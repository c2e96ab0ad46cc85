"""Images for chapter 12: synthetic ImageNet-shaped ones, or a folder, sharded like the text.

A global batch is B *positions* in an endless stream, ``step * B .. step * B + B - 1``; each
position names one sample and the seed of its augmentation. A rank keeps its contiguous
shard of the positions (``shard_batch``, the text loader's rule) and decodes only those, so
the pixels of a position are the same at any number of ranks, and after a resume:

    step t: positions tB .. tB+B-1 --shard_batch--> rank r: its B/N positions
            position p -> sample index (synthetic: p; a folder: a seeded permutation per epoch)
                       -> pixels, augmented with a generator seeded by (seed, p)

- ``SyntheticImages``: each class is a fixed random pattern (seeded), each image its class's
  pattern plus noise drawn from (seed, index): learnable, and no file to download.
- ``ImageFolder``: ``root/<class>/<image>`` in any format Pillow reads (JPEG, PNG, PPM, ...;
  the ``vision`` extra). ``check`` reads every file's header before the run starts: an empty
  folder, one class, a file that is not an image or images of mixed sizes without
  ``resize`` are an ``InputError`` naming the file.
"""

import contextlib
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from scaletorch.data.loader import shard_batch
from scaletorch.rules.errors import InputError, MissingInputError, clip

Sample = Tuple[np.ndarray, int]  # (3, S, S) float32, class index


class SyntheticImages:
    """``num_classes`` patterns of 3 x ``image_size`` x ``image_size``; sample i is a function
    of (seed, i) only. The patterns are 8 x 8 blocks, so a small network can learn them."""

    def __init__(self, num_classes: int, image_size: int, seed: int) -> None:
        if num_classes < 2 or image_size < 8:
            raise ValueError(f"synthetic images need at least 2 classes and 8 pixels a side, "
                             f"got num_classes {num_classes}, image_size {image_size}")
        self.num_classes, self.image_size, self.seed = num_classes, image_size, seed
        # (K, 3, 8, 8), blown up per image: 1000 classes at 224 x 224 would be 600 MB
        rng = np.random.default_rng([seed, 0])
        self.patterns = rng.standard_normal((num_classes, 3, 8, 8)).astype(np.float32)

    def __len__(self) -> int:
        return 0  # endless: every position is a new sample

    def load(self, index: int) -> Sample:
        rng = np.random.default_rng([self.seed, 1, index])
        label = int(rng.integers(self.num_classes))
        s, reps = self.image_size, -(-self.image_size // 8)
        pattern = self.patterns[label].repeat(reps, axis=1).repeat(reps, axis=2)[:, :s, :s]
        return pattern + rng.standard_normal((3, s, s), dtype=np.float32), label


def _pillow() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise InputError("reading an image folder needs Pillow: pip install -e .[vision]") from None
    return PIL.Image


@contextlib.contextmanager
def _reading(path: str, problem: str) -> Iterator[None]:
    """Pillow's errors while it reads ``path`` as one InputError naming the file: a damaged
    file raises OSError, SyntaxError, ValueError, struct.error and more, and an image of more
    than PIL.Image.MAX_IMAGE_PIXELS (89 million) pixels is a decompression bomb (its warning
    is an error here: a real training image is far smaller)."""
    image = _pillow()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", image.DecompressionBombWarning)
            yield
    except InputError:
        raise
    except (image.DecompressionBombError, image.DecompressionBombWarning) as err:
        raise InputError(f"image folder: {clip(path)} is too large to decode ({err}); a "
                         f"training image has at most {image.MAX_IMAGE_PIXELS} pixels: "
                         f"remove it or scale it down") from None
    except Exception as err:  # noqa: B902 - any failure of Pillow's decoders is the file's
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(f"image folder: {clip(path)} {problem} ({clip(reason)}); remove it "
                         f"or replace it") from None


class ImageFolder:
    """``root/<class>/<file>``: classes in sorted order (label = position), files sorted."""

    def __init__(self, root: str, resize: Optional[int] = None) -> None:
        self.root, self.resize = root, resize
        self.classes, self.files = self.check(root, resize)
        self.num_classes = len(self.classes)
        self.image_size = resize or self._size(self.files[0][0])[0]

    @staticmethod
    def _size(path: str) -> Tuple[int, int]:
        with _reading(path, "is not an image Pillow can read"):
            with _pillow().open(path) as im:  # reads the header only
                return im.size

    @classmethod
    def check(cls, root: str, resize: Optional[int]) -> Tuple[List[str], List[Tuple[str, int]]]:
        """(classes, [(file, label)]) of ``root``, or an InputError that names what is wrong."""
        if not os.path.isdir(root):
            raise MissingInputError(f"image folder {root!r} does not exist or is not a folder")
        if resize is not None and resize < 8:
            raise InputError(f"resize must be at least 8 pixels, got {resize}")
        classes = sorted(d for d in os.listdir(root)
                         if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
        files = []
        for label, name in enumerate(classes):
            folder = os.path.join(root, name)
            files += [(os.path.join(folder, f), label) for f in sorted(os.listdir(folder))
                      if not f.startswith(".")]
        if not files:
            raise InputError(f"image folder {root!r} holds no images: expected "
                             f"{root}/<class>/<image>, one folder per class")
        used = sorted({classes[label] for _, label in files})
        if len(used) < 2:
            raise InputError(f"image folder {root!r} holds images of one class only "
                             f"({used[0]!r}): a classifier needs at least 2")
        sizes: Dict[Tuple[int, int], str] = {}  # size -> the first file of that size
        for path, _ in files:
            sizes.setdefault(cls._size(path), path)
        if len(sizes) > 1 and resize is None:
            (a, first), (b, other) = list(sizes.items())[:2]
            raise InputError(f"image folder {root!r} holds images of mixed sizes ({first!r} is "
                             f"{a[0]}x{a[1]}, {other!r} is {b[0]}x{b[1]}): pass --resize S")
        if resize is None and list(sizes)[0][0] != list(sizes)[0][1]:
            raise InputError(f"image folder {root!r}: images are {list(sizes)[0]} (not square): "
                             f"pass --resize S")
        return classes, files

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int) -> Sample:
        path, label = self.files[index]
        image = _pillow()
        with _reading(path, "could not be decoded"):
            with image.open(path) as im:
                rgb = im.convert("RGB")
                if self.resize is not None:
                    rgb = rgb.resize((self.resize, self.resize), image.Resampling.BILINEAR)
                pixels = np.asarray(rgb, dtype=np.float32)  # (S, S, 3), 0..255
        return (pixels.transpose(2, 0, 1) / 127.5 - 1.0).astype(np.float32), label


Dataset = Any  # SyntheticImages | ImageFolder: num_classes, image_size, __len__, load


def augment(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random horizontal flip and a random crop of the image padded by 1/8 of its side."""
    if rng.random() < 0.5:
        image = image[:, :, ::-1]
    size = image.shape[-1]
    pad = max(1, size // 8)
    padded = np.pad(image, ((0, 0), (pad, pad), (pad, pad)))
    dy, dx = rng.integers(0, 2 * pad + 1, size=2)
    return np.ascontiguousarray(padded[:, dy:dy + size, dx:dx + size])


class ImageBatchLoader:
    """Global batches of images: ``local_batch(step, rank, world)`` is this rank's shard."""

    def __init__(self, dataset: Dataset, global_batch_size: int, seed: int,
                 augmentation: bool = True) -> None:
        if global_batch_size <= 0 or seed < 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be positive and "
                             f"seed ({seed}) non-negative")
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.seed, self.augmentation = seed, augmentation
        self._epoch: Tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))  # its permutation

    def sample_index(self, position: int) -> int:
        """The sample at ``position``: itself (endless data), or the epoch's permutation."""
        n = len(self.dataset)
        if n == 0:
            return position
        epoch, offset = divmod(position, n)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, 2, epoch]).permutation(n))
        return int(self._epoch[1][offset])

    def local_batch(self, step: int, rank: int = 0,
                    world_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """images (B/N, 3, S, S) float32, labels (B/N,) int64: shard ``rank`` of step's batch."""
        b = self.global_batch_size
        positions = shard_batch(torch.arange(step * b, (step + 1) * b), rank, world_size)
        images, labels = [], []
        for p in positions.tolist():
            image, label = self.dataset.load(self.sample_index(p))
            if self.augmentation:
                image = augment(image, np.random.default_rng([self.seed, 3, p]))
            images.append(image)
            labels.append(label)
        return torch.from_numpy(np.stack(images)), torch.tensor(labels, dtype=torch.int64)
