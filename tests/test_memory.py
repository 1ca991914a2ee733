"""The paper's memory table, reproduced from the library's own state layout."""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.memory import (
    LLAMA_CONFIGS,
    PAPER_GB,
    PAPER_MEMORY_TABLE,
    PAPER_ROWS,
    llama_parameters,
    paper_memory_table,
    state_nbytes,
)

MODELS = ["llama-60m", "llama-130m", "llama-350m", "llama-1.3b"]

# The reproduced table in bytes (bf16, rule="paper").  Pinned exactly: any change to the
# state layout (a new buffer, a basis formed on another side) shows up here.
PINNED_BYTES = {
    "Adam": (232259584, 536346624, 1471676416, 5355929600),
    "AdaDiag": (261619712, 635437056, 1823997952, 6765215744),
    "AdaDiag++": (369278976, 994050048, 3103264768, 11864965136),
    "Adafactor w/ momentum": (181821952, 366827520, 867844864, 2941976528),
    "Adafactor w/o momentum": (65692160, 98654208, 132006656, 264011728),
    "AdafacDiag w/ momentum": (211182080, 465917952, 1220166400, 4351262672),
    "AdafacDiag w/o momentum": (95052288, 197744640, 484328192, 1673297872),
    "Hfac": (131384320, 197308416, 264013312, 528023456),
    "HfacDiag": (160744448, 296398848, 616334848, 1937309600),
}


def test_reproduces_every_library_row_of_the_paper() -> None:
    table = paper_memory_table(MODELS)
    for label in PAPER_ROWS:
        got = tuple(round(table[label][m] / PAPER_GB, 2) for m in MODELS)
        assert got == PAPER_MEMORY_TABLE[label], label


def test_pinned_bytes() -> None:
    table = paper_memory_table(MODELS)
    assert {k: tuple(v[m] for m in MODELS) for k, v in table.items()} == PINNED_BYTES


def test_counts_what_init_allocates() -> None:
    # rule="all" on real (small) arrays equals the nbytes of ar.init's state, counter excluded.
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(6, 10), (10, 6), (7,), (3, 2, 2)]]
    for name in ar.OPTIMIZERS:
        cfg = ar.make_config(name)
        want = 0
        for p in params:
            st = ar.init(p, cfg)
            want += sum(getattr(st, f).nbytes for f in st._fields if f != "count" and getattr(st, f) is not None)
        assert state_nbytes(params, cfg, dtype="fp32", rule="all") == want, name


def test_formulas_of_the_table_header() -> None:
    # One m x n block matrix (m <= n): 2mn, m^2 + 2mn, m^2 + n^2 + 2mn, mn + m + n, m + n, m^2 + ... (elements).
    m, n = 4, 9
    expect = {
        ("adamw", ()): 2 * m * n,
        ("adadiag", ()): m * m + 2 * m * n,
        ("adadiag_pp", ()): m * m + n * n + 2 * m * n,
        ("adafactor", ()): m * n + m + n,
        ("adafactor", (("momentum", False),)): m + n,
        ("adafacdiag", (("momentum", False),)): m * m + m + n,
        ("hfac", ()): 2 * (m + n),
        ("hfacdiag", ()): m * m + 2 * (m + n),
    }
    for (name, opts), elements in expect.items():
        assert state_nbytes([(n, m)], name, dtype="bf16", **dict(opts)) == 2 * elements, name


def test_max_basis_dim_and_embedding_rules() -> None:
    emb = llama_parameters("llama-60m")[0]
    assert emb.shape == (32000, 512) and emb.role == "embedding"
    # Under rule="all" the embedding gets P (512 x 512) but never a 32000 x 32000 Q (max_basis_dim = 8192).
    got = state_nbytes([emb._replace(role="block")], "adadiag_pp", dtype="fp32", rule="all")
    assert got == 4 * (512 * 512 + 2 * 512 * 32000)
    assert set(LLAMA_CONFIGS) == set(MODELS)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        state_nbytes("llama-60m", "adamw", dtype="int7")
    with pytest.raises(ValueError):
        state_nbytes("llama-60m", "adamw", rule="some")


def test_memory_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from adadiag_ref.perf.cli import main

    assert main(["memory", "--model", "llama-60m", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "AdaDiag++" in out and "0.36G" in out and "MISMATCH" not in out
