"""Thin framework adapters over the array-API core (``adadiag_ref.adapters``).

``adadiag_ref.adapters.pytorch`` and ``adadiag_ref.adapters.optax`` import their
framework lazily; importing this package imports neither.
"""
