"""NumPy stand-ins for ``cupy.ElementwiseKernel`` and ``cupy.ReductionKernel``: the CuPy routes' kernel bodies
evaluated on the CPU, so that ``tests/test_cupy_kernels.py`` can compare them with ``kernels="reference"`` without
a GPU.

A kernel body is CUDA C; this module translates the small subset of it that the routes' bodies use and refuses
everything else (:class:`Unsupported`) rather than guess what it means:

* statements ``T name = e;``, ``const T name = e;`` (a new local) and ``name = e;`` (a local or an output);
* ``+ - * /`` with C's precedence and left associativity, unary ``-``, parentheses;
* ``sqrt``, ``fmax``, ``fmin``; a ternary ``c ? a : b`` over one comparison ``< > <= >= == !=``;
* casts ``(T)e`` and ``T(e)``; a numeric literal only as the operand of such a cast (a bare ``0.5`` is a C
  ``double`` and would promote a float32 body, so it is refused, as ``test_kernel_sources_are_consistent``
  refuses it in the sources).

Every parameter is typed ``T``, the one floating dtype of the call's arrays.  Each operation runs as one NumPy
operation on values of that dtype, and every intermediate result is checked to still have it: NumPy's float32
and float64 ``+ - * /`` and ``sqrt`` are correctly rounded, as CUDA's are with ``--fmad=false`` (no multiply-add
contraction) and its default IEEE division and square root.  So a body that performs the reference's operations
in the reference's order gives the reference's bits.  CuPy compiles with ``-ftz=true`` (float32 subnormals
flushed to zero) and NumPy keeps subnormals; the trajectories compared here never produce one.

A call follows CuPy's semantics for what the routes pass: every argument, inputs then outputs, is given (the
outputs preallocated); arrays broadcast against the outputs' shape (a 0-d array is a device coefficient, a
``(1, n)`` or ``(m, 1)`` array a broadcast vector); scalars are NumPy scalars of ``T`` (a host coefficient);
an output reads its old entries until the body assigns it, and the outputs are written when the body is done;
inputs never overlap outputs.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np

__all__ = ["ElementwiseKernel", "ReductionKernel", "Unsupported", "parse_body", "parse_expression"]


class Unsupported(ValueError):
    """The body uses C that this translator does not evaluate (or a call the routes never make)."""


_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)(?![\w.])|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op><=|>=|==|!=|[-+*/()?:;<>=,]))"
)
_FUNCTIONS = {"sqrt": (1, np.sqrt), "fmax": (2, np.fmax), "fmin": (2, np.fmin)}
_BINARY = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide}
_COMPARE = {"<": np.less, ">": np.greater, "<=": np.less_equal, ">=": np.greater_equal, "==": np.equal,
            "!=": np.not_equal}  # fmt: skip
_KEYWORDS = {"T", "const", *_FUNCTIONS}


def _tokens(source: str) -> list[str]:
    out, pos = [], 0
    source = source.rstrip()
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None or match.end() == pos:
            raise Unsupported(f"cannot read {source[pos : pos + 20]!r} in {source!r}")
        out.append(match.group(match.lastgroup or ""))
        pos = match.end()
    return out


class _Parser:
    """Recursive descent over the tokens; expressions become nested tuples ``(kind, ...)``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.toks = _tokens(source)
        self.pos = 0

    def peek(self, k: int = 0) -> str | None:
        return self.toks[self.pos + k] if self.pos + k < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise Unsupported(f"expected {expected or 'more'} at token {self.pos} ({tok!r}) in {self.source!r}")
        self.pos += 1
        return tok

    def done(self) -> bool:
        return self.pos == len(self.toks)

    def statements(self) -> list[tuple[Any, ...]]:
        out = []
        while not self.done():
            if self.peek() == ";":
                self.take()
                continue
            if self.peek() in ("const", "T"):
                if self.peek() == "const":
                    self.take()
                self.take("T")
                kind = "declare"
            elif self.peek() in ("float", "double", "int", "auto", "unsigned", "long", "bool"):
                raise Unsupported(f"only the kernel's type T is allowed, not {self.peek()!r}: {self.source!r}")
            else:
                kind = "assign"
            name = self.name()
            self.take("=")
            out.append((kind, name, self.expression()))
            if not self.done():
                self.take(";")
        return out

    def name(self) -> str:
        tok = self.take()
        if not re.fullmatch(r"[A-Za-z_]\w*", tok) or tok in _KEYWORDS:
            raise Unsupported(f"expected a name, got {tok!r} in {self.source!r}")
        return tok

    def expression(self) -> tuple[Any, ...]:
        cond = self.comparison()
        if self.peek() != "?":
            return cond
        self.take("?")
        a = self.expression()
        self.take(":")
        return ("where", cond, a, self.expression())

    def comparison(self) -> tuple[Any, ...]:
        left = self.additive()
        if self.peek() in _COMPARE:
            op = self.take()
            left = ("compare", op, left, self.additive())
            if self.peek() in _COMPARE:
                raise Unsupported(f"chained comparison in {self.source!r}")
        return left

    def additive(self) -> tuple[Any, ...]:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            left = ("binary", op, left, self.term())
        return left

    def term(self) -> tuple[Any, ...]:
        left = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            left = ("binary", op, left, self.unary())
        return left

    def unary(self) -> tuple[Any, ...]:
        if self.peek() == "-":
            self.take()
            return ("negate", self.unary())
        if self.peek() == "(" and self.peek(1) == "T" and self.peek(2) == ")":
            self.pos += 3
            return ("cast", self.unary())
        return self.primary()

    def primary(self) -> tuple[Any, ...]:
        tok = self.take()
        if tok == "(":
            inner = self.expression()
            self.take(")")
            return inner
        if re.fullmatch(r"[\d.].*", tok):
            return ("literal", tok)
        if tok == "T":
            self.take("(")
            inner = self.expression()
            self.take(")")
            return ("cast", inner)
        if tok in _FUNCTIONS:
            self.take("(")
            args = [self.expression()]
            while self.peek() == ",":
                self.take()
                args.append(self.expression())
            self.take(")")
            if len(args) != _FUNCTIONS[tok][0]:
                raise Unsupported(f"{tok} takes {_FUNCTIONS[tok][0]} arguments in {self.source!r}")
            return ("call", tok, *args)
        self.pos -= 1
        name = self.name()
        if self.peek() == "(":
            raise Unsupported(f"unknown function {name!r} in {self.source!r}")
        return ("name", name)


def _refuse_bare_literals(expr: Any, cast: bool = False) -> None:
    """A literal outside ``(T)`` / ``T()`` is a C ``double`` (or ``int``): refused where it is written."""
    if not isinstance(expr, tuple):
        return
    if expr[0] == "literal" and not cast:
        raise Unsupported(f"bare literal {expr[1]} (a C double or int): write it as (T){expr[1]}")
    for part in expr[1:]:
        _refuse_bare_literals(part, expr[0] == "cast")


def parse_body(source: str) -> list[tuple[Any, ...]]:
    """The statements of a kernel body: ``(kind, name, expression)`` with kind ``"declare"`` or ``"assign"``."""
    statements = _Parser(source).statements()
    for _, _, expr in statements:
        _refuse_bare_literals(expr)
    return statements


def parse_expression(source: str) -> tuple[Any, ...]:
    """One expression (a reduction's map or reduce expression)."""
    parser = _Parser(source)
    expr = parser.expression()
    if not parser.done():
        raise Unsupported(f"trailing tokens after the expression {source!r}")
    _refuse_bare_literals(expr)
    return expr


def _evaluate(expr: tuple[Any, ...], env: dict[str, Any], dtype: np.dtype) -> Any:
    """``expr`` over ``env`` (NumPy values of ``dtype``), one NumPy operation per C operation, each checked to
    stay in ``dtype`` (a comparison gives bool)."""
    kind = expr[0]
    if kind == "name":
        if expr[1] not in env:
            raise Unsupported(f"{expr[1]!r} is neither a parameter nor a local")
        return env[expr[1]]
    if kind == "cast":
        if expr[1][0] == "literal":
            return dtype.type(float(expr[1][1]))  # C: the double literal converted to T, round to nearest
        return _typed(_evaluate(expr[1], env, dtype), dtype, "(T)")
    if kind == "negate":
        return _typed(np.negative(_evaluate(expr[1], env, dtype)), dtype, "-")
    if kind == "binary":
        a, b = _evaluate(expr[2], env, dtype), _evaluate(expr[3], env, dtype)
        return _typed(_BINARY[expr[1]](_typed(a, dtype, expr[1]), _typed(b, dtype, expr[1])), dtype, expr[1])
    if kind == "call":
        args = [_typed(_evaluate(a, env, dtype), dtype, expr[1]) for a in expr[2:]]
        return _typed(_FUNCTIONS[expr[1]][1](*args), dtype, expr[1])
    if kind == "compare":
        a, b = _evaluate(expr[2], env, dtype), _evaluate(expr[3], env, dtype)
        return _COMPARE[expr[1]](_typed(a, dtype, expr[1]), _typed(b, dtype, expr[1]))
    if kind == "where":
        cond = _evaluate(expr[1], env, dtype)
        if np.asarray(cond).dtype != np.bool_:
            raise Unsupported("a ternary's condition must be a comparison")
        a, b = _evaluate(expr[2], env, dtype), _evaluate(expr[3], env, dtype)
        return _typed(np.where(cond, _typed(a, dtype, "?:"), _typed(b, dtype, "?:")), dtype, "?:")
    raise Unsupported(f"cannot evaluate {kind!r}")  # pragma: no cover - the parser makes no other node


def _typed(value: Any, dtype: np.dtype, op: str) -> Any:
    if np.asarray(value).dtype != dtype:
        raise Unsupported(f"{op} gave {np.asarray(value).dtype}, not the kernel type {dtype}")
    return value


def _params(spec: str) -> list[str]:
    """The names of ``"T a, T b"``; any other type or qualifier is refused (the routes type every parameter T)."""
    names = []
    for param in spec.split(","):
        words = param.split()
        if len(words) != 2 or words[0] != "T" or not re.fullmatch(r"[A-Za-z_]\w*", words[1]) or words[1] == "i":
            raise Unsupported(f"parameter {param.strip()!r}: only 'T name' is evaluated")
        names.append(words[1])
    return names


def _dtype_of(values: list[Any]) -> np.dtype:
    dtypes = {np.asarray(v).dtype for v in values}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (np.float32, np.float64):
        raise Unsupported(f"the arguments must share one float32/float64 dtype T, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _argument(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic) and not isinstance(value, np.bool_):
        return value
    raise Unsupported(f"argument {value!r} of {type(value).__name__}: the routes pass NumPy scalars or arrays")


class ElementwiseKernel:
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name, options=...)`` on NumPy arrays.

    ``calls`` records ``(name, dtype, kinds)`` for every call, ``kinds`` one entry per argument: ``"scalar"`` or
    the array's ``ndim``."""

    calls: ClassVar[list[tuple[str, str, tuple[Any, ...]]]] = []

    def __init__(self, in_params: str, out_params: str, operation: str, name: str, options: tuple = ()) -> None:
        self.in_names, self.out_names = _params(in_params), _params(out_params)
        self.name, self.options = name, tuple(options)
        if len(set(self.in_names + self.out_names)) != len(self.in_names) + len(self.out_names):
            raise Unsupported(f"{name}: a parameter name repeats")
        self.body = parse_body(operation)
        self._check_names()

    def _check_names(self) -> None:
        known, outputs = set(self.in_names + self.out_names), set(self.out_names)
        for kind, name, _ in self.body:
            if kind == "declare":
                if name in known:
                    raise Unsupported(f"{self.name}: {name!r} declared twice")
                known.add(name)
            elif name not in outputs and name not in known - set(self.in_names):
                raise Unsupported(f"{self.name}: assignment to {name!r}, which is not an output or a local")

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.in_names) + len(self.out_names):
            raise Unsupported(f"{self.name}: pass every input and output ({len(args)} arguments given)")
        args = tuple(_argument(a) for a in args)
        dtype = _dtype_of(list(args))
        ins, outs = args[: len(self.in_names)], args[len(self.in_names) :]
        if not all(isinstance(o, np.ndarray) for o in outs) or len({o.shape for o in outs}) != 1:
            raise Unsupported(f"{self.name}: the outputs must be preallocated arrays of one shape")
        shape = outs[0].shape
        for a in ins:
            if isinstance(a, np.ndarray) and any(np.may_share_memory(a, o) for o in outs):
                raise Unsupported(f"{self.name}: an input overlaps an output")
        ElementwiseKernel.calls.append((self.name, str(dtype), tuple(a.ndim if isinstance(a, np.ndarray) else "scalar"
                                                                      for a in args)))  # fmt: skip
        env: dict[str, Any] = {}
        for name, a in zip(self.in_names, ins, strict=True):
            env[name] = np.broadcast_to(a, shape) if isinstance(a, np.ndarray) else a
        for name, o in zip(self.out_names, outs, strict=True):
            env[name] = o.copy()  # read until assigned; written back when the body is done
        for _, name, expr in self.body:
            env[name] = _typed(np.broadcast_to(_evaluate(expr, env, dtype), shape), dtype, "=")
        for name, o in zip(self.out_names, outs, strict=True):
            o[...] = env[name]
        return outs[0] if len(outs) == 1 else outs


class ReductionKernel:
    """``cupy.ReductionKernel(in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name)`` over
    every entry of one input array: ``map_expr`` per entry, then ``reduce_expr`` over ``a``, ``b`` in the order
    ``order`` names, then ``post_map_expr`` with ``a`` the reduced value; returns the 0-d output.

    ``order`` (class attribute): ``"numpy"`` sums as NumPy's ``sum`` does (pairwise, the reference's ``mean``),
    allowed only for the reduction ``a + b``; ``"tree"`` halves the entries pairwise (``x[0::2] + x[1::2]``,
    padded with the identity), one of the orders a GPU reduction may take."""

    order: ClassVar[str] = "numpy"

    def __init__(self, in_params: str, out_params: str, map_expr: str, reduce_expr: str, post_map_expr: str,
                 identity: str, name: str, options: tuple = ()) -> None:  # fmt: skip
        self.in_names, self.out_names = _params(in_params), _params(out_params)
        if len(self.in_names) != 1 or len(self.out_names) != 1:
            raise Unsupported(f"{name}: one input and one output only")
        self.name = name
        self.map = parse_expression(map_expr)
        self.reduce = parse_expression(reduce_expr)
        self.post = parse_body(post_map_expr)
        self.identity = parse_expression(f"(T){identity}")

    def __call__(self, x: Any) -> Any:
        x = _argument(x)
        dtype = _dtype_of([x])
        ElementwiseKernel.calls.append((self.name, str(dtype), (x.ndim,)))
        mapped = _typed(_evaluate(self.map, {self.in_names[0]: x}, dtype), dtype, "map")
        total = self._reduced(np.asarray(mapped), dtype)
        env = {"a": total, self.out_names[0]: dtype.type(0)}
        for _, name, expr in self.post:
            env[name] = _evaluate(expr, env, dtype)
        return np.asarray(env[self.out_names[0]], dtype=dtype)

    def _reduced(self, mapped: np.ndarray, dtype: np.dtype) -> Any:
        if self.order == "numpy":
            if self.reduce != ("binary", "+", ("name", "a"), ("name", "b")):
                raise Unsupported(f"{self.name}: NumPy's order only for the reduction a + b")
            return np.add.reduce(mapped, axis=None)
        level = mapped.reshape(-1)
        identity = _evaluate(self.identity, {}, dtype)
        while level.size > 1:
            if level.size % 2:
                level = np.concatenate([level, np.full(1, identity, dtype=dtype)])
            level = _evaluate(self.reduce, {"a": level[0::2], "b": level[1::2]}, dtype)
        return level[0] if level.size else identity
