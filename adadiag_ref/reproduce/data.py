"""Data for the two tasks; nothing is downloaded.

* ``charlm``: characters of a fixed, sorted list of modules of the Python standard library's own source
  (found with ``sysconfig.get_paths()["stdlib"]``).  The source differs between Python versions, so every run
  records the Python version and a SHA-256 of the corpus text.
* ``digits``: scikit-learn's bundled 8x8 handwritten digits (``sklearn.datasets.load_digits``).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

# Long-lived single-file modules (present as files from Python 3.10 to 3.13), in sorted order.
STDLIB_MODULES = (
    "argparse.py", "ast.py", "bisect.py", "calendar.py", "configparser.py", "contextlib.py", "copy.py", "csv.py",
    "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py",
    "inspect.py", "ipaddress.py", "operator.py", "pprint.py", "random.py", "shutil.py", "statistics.py",
    "string.py", "subprocess.py", "tarfile.py", "textwrap.py", "threading.py", "typing.py", "uuid.py",
)  # fmt: skip

UNKNOWN = 0
VOCAB = ("\0", "\n", *(chr(c) for c in range(32, 127)))
"""Fixed character vocabulary: index 0 stands for every character outside it (tabs, non-ASCII)."""
VALIDATION_FRACTION = 0.1


class Corpus(NamedTuple):
    """Token ids of the training and validation text, with what identifies the text."""

    train: torch.Tensor
    val: torch.Tensor
    files: tuple[str, ...]
    sha256: str


def encode(text: str) -> torch.Tensor:
    """Character ids under ``VOCAB`` (int64); characters outside it map to ``UNKNOWN``."""
    index = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([index.get(ch, UNKNOWN) for ch in text], dtype=torch.int64)


def load_corpus(stdlib: str | Path | None = None) -> Corpus:
    """Read ``STDLIB_MODULES`` from the standard library; each file's first 90% trains, its last 10% validates.

    A module missing in this Python version is skipped (``files`` lists the ones read)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = tuple(name for name in STDLIB_MODULES if (root / name).is_file())
    if not found:
        raise FileNotFoundError(f"none of the corpus modules is in {root}: is this a full Python installation?")
    texts = [(root / name).read_text(encoding="utf-8") for name in found]
    digest = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()
    cuts = [round(len(text) * (1 - VALIDATION_FRACTION)) for text in texts]
    train = encode("".join(text[:cut] for text, cut in zip(texts, cuts)))
    val = encode("".join(text[cut:] for text, cut in zip(texts, cuts)))
    return Corpus(train, val, found, digest)


def random_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``length + 1`` consecutive tokens at uniform random starts (inputs and targets)."""
    starts = torch.randint(0, len(tokens) - length - 1, (batch,), generator=generator)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])


def fixed_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length + 1`` tokens at evenly spaced starts: the same validation set every run."""
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(np.int64)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])


class Digits(NamedTuple):
    """Images ``(n, 1, 8, 8)`` scaled to [0, 1] and labels, split into training and validation."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def load_digits_split() -> Digits:
    """scikit-learn's digits (1797 images); a fixed permutation (seed 0) puts 20% in validation."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(labels)))
    n_val = round(len(labels) * 0.2)
    val, train = order[:n_val], order[n_val:]
    return Digits(images[train], labels[train], images[val], labels[val])
