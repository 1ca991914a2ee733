"""Golden vectors: a versioned fixture format, its generator and verifier (``docs/golden.md``).

* :mod:`~adadiag_ref.golden.format`: the on-disk format (``manifest.json`` + ``.npz``)
  and :class:`GoldenCase`;
* :mod:`~adadiag_ref.golden.generator`: the seeded gradient streams and :func:`generate`;
* :mod:`~adadiag_ref.golden.verify`: :func:`verify`, the live core against a fixture set;
* :mod:`~adadiag_ref.golden.cli`: ``adadiag-ref golden ...`` and ``adadiag-ref replay``;
* :mod:`~adadiag_ref.golden.conform`: ``adadiag-ref conform``, a torch class, an optax factory or a
  command over every case (text, JSON and JUnit reports).

The comparison harness for other implementations is :mod:`adadiag_ref.testing`.
"""

from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GoldenCase,
    Tolerance,
    api_config,
    api_options,
    config_from_dict,
    config_to_dict,
    default_data_dir,
    load_case,
    load_cases,
    load_manifest,
)
from .generator import STREAMS, CaseSpec, Stream, case_specs, generate, make_case, make_stream, run_core
from .verify import CaseResult, verify, verify_case

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "STREAMS",
    "CaseResult",
    "CaseSpec",
    "GoldenCase",
    "Stream",
    "Tolerance",
    "api_config",
    "api_options",
    "case_specs",
    "config_from_dict",
    "config_to_dict",
    "default_data_dir",
    "generate",
    "load_case",
    "load_cases",
    "load_manifest",
    "make_case",
    "make_stream",
    "run_core",
    "verify",
    "verify_case",
]
