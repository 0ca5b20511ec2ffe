"""Kernel-name normalization: one stable name per kernel, whatever library version or tool reported it.

The L3 detector compares a kernel's durations across ranks and over time, keyed by name. Raw names break
that key in two ways: the *same* kernel is spelled differently by different library versions and tools
(NCCL renamed every kernel in 2.19; CUPTI reports mangled symbols, Kineto demangled ones with argument
lists), and a careless cleanup would merge *different* kernels (two GEMM tile configurations, AllReduce
and ReduceScatter) whose durations have nothing in common. :func:`normalize` applies these rules, in order:
see docs/internals/producers.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import re
from collections.abc import Callable
from functools import lru_cache

__all__ = ["MAX_LEN", "RENAMES", "demangle", "memcpy_name", "normalize"]

log = logging.getLogger(__name__)

#: Longest normalized name; longer ones are cut and suffixed with a hash (rule 7).
MAX_LEN = 512
#: Wrapper templates renamed between library versions: old spelling -> the one kept (rule 5).
RENAMES: dict[str, str] = {"cutlass::Kernel2<": "cutlass::Kernel<"}

_HASHED = re.compile(r"~[0-9a-f]{12}$")
_SPACES = re.compile(r"\s+")

# -- demangling ------------------------------------------------------------------------------------------

_Demangler = Callable[[bytes], str | None]


def _load_demangler() -> _Demangler | None:
    """``__cxa_demangle`` from the C++ runtime through ctypes, or None where there is none."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        fn = lib.__cxa_demangle
        libc = ctypes.CDLL(None)
        free = libc.free
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    free.argtypes = [ctypes.c_void_p]
    free.restype = None

    def run(symbol: bytes) -> str | None:
        status = ctypes.c_int(0)
        ptr = fn(symbol, None, None, ctypes.byref(status))
        if not ptr:
            return None
        try:
            return ctypes.string_at(ptr).decode("utf-8", "replace") if status.value == 0 else None
        finally:
            free(ptr)

    return run


_DEMANGLER = _load_demangler()
_SIMPLE_MANGLED = re.compile(r"_Z(\d+)")


@lru_cache(maxsize=65_536)
def demangle(symbol: str) -> str:
    """The demangled form of a C++ symbol (``_Z...``); other strings, and failures, come back unchanged.

    Without a C++ runtime only the plain ``_Z<len><name>...`` form (a non-nested function, e.g. every NCCL
    kernel) is decoded, to ``<name>``.
    """
    if not symbol.startswith("_Z"):
        return symbol
    if _DEMANGLER is not None:
        out = _DEMANGLER(symbol.encode("utf-8", "replace"))
        if out:
            return out
    m = _SIMPLE_MANGLED.match(symbol)
    if m is not None:
        n = int(m.group(1))
        name = symbol[m.end():m.end() + n]
        if len(name) == n and re.fullmatch(r"[A-Za-z_]\w*", name):
            return name
    return symbol


# -- copies and sets -------------------------------------------------------------------------------------

#: CUPTI ``ActivityMemcpyKind`` values -> the direction in ``memcpy:<dir>``.
_COPY_KINDS = {0: "unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
               8: "DtoD", 9: "HtoH", 10: "PtoP"}
_COPY_BY_LOWER = {v.lower(): v for v in _COPY_KINDS.values()}
_MEMCPY = re.compile(r"^memcpy\s+([A-Za-z]+)\b", re.IGNORECASE)
_MEMSET = re.compile(r"^memset\b", re.IGNORECASE)


def memcpy_name(copy_kind: int) -> str:
    """``memcpy:<direction>`` for a CUPTI ``ActivityMemcpyKind`` value (``memcpy:unknown`` if unknown)."""
    return "memcpy:" + _COPY_KINDS.get(int(copy_kind), "unknown")


# -- NCCL ------------------------------------------------------------------------------------------------

_COLLECTIVES = ("AllReduce", "AllGatherV", "AllGather", "ReduceScatter", "Reduce", "Broadcast", "SendRecv",
                "Send", "Recv", "AllToAll", "Generic")
#: Collectives without a reduction: their op/type parts are dummies in old NCCL names and are dropped.
_NO_REDUCTION = frozenset({"AllGatherV", "AllGather", "Broadcast", "SendRecv", "Send", "Recv", "AllToAll"})
_OPS = ("Sum", "Prod", "Min", "Max", "PreMulSum", "SumPostDiv", "Avg")
_TYPES = {
    "int8_t": "i8", "i8": "i8", "char": "i8", "uint8_t": "u8", "u8": "u8", "int32_t": "i32", "i32": "i32",
    "int": "i32", "uint32_t": "u32", "u32": "u32", "uint": "u32", "int64_t": "i64", "i64": "i64",
    "uint64_t": "u64", "u64": "u64", "half": "f16", "__half": "f16", "f16": "f16", "float": "f32",
    "f32": "f32", "double": "f64", "f64": "f64", "bfloat16": "bf16", "__nv_bfloat16": "bf16", "bf16": "bf16",
    "f8e4m3": "f8e4m3", "fp8_e4m3": "f8e4m3", "__nv_fp8_e4m3": "f8e4m3", "f8e5m2": "f8e5m2",
    "fp8_e5m2": "f8e5m2", "__nv_fp8_e5m2": "f8e5m2",
}
_ALGOS = ("COLLNET_DIRECT", "COLLNET_CHAIN", "COLLNET", "NVLS_TREE", "NVLS", "RING", "TREE", "PAT")
_PROTOS = ("LL128", "LL", "SIMPLE")

#: lower-case spelling -> (part, canonical spelling)
_NCCL_TOKENS: dict[str, tuple[str, str]] = {
    **{c.lower(): ("coll", c) for c in _COLLECTIVES},
    "alltoall": ("coll", "AllToAll"),
    **{o.lower(): ("op", o) for o in _OPS},
    **{t.lower(): ("type", c) for t, c in _TYPES.items()},
    **{a.lower(): ("algo", a) for a in _ALGOS},
    **{p.lower(): ("proto", p) for p in _PROTOS},
}
_NCCL_TOKEN_RE = re.compile(
    "(" + "|".join(re.escape(t) for t in sorted(_NCCL_TOKENS, key=len, reverse=True)) + r")(?=_|$)",
    re.IGNORECASE)
_NCCL_PREFIX = re.compile(r"^(?:ncclDevKernel|ncclKernel)_(?P<rest>\w+)$")
_NCCL_OLD = re.compile(
    r"^nccl(?P<coll>[A-Za-z]+?)(?P<algo>Ring|Tree|CollNet)?(?P<proto>LL128|LL|Simple)?Kernel"
    r"(?:_(?P<op>[a-z]+)_(?P<type>\w+))?$")


def _nccl(base: str) -> str | None:
    """The ``nccl:...`` name of an NCCL kernel base name (no arguments), or None if it is not one."""
    m = _NCCL_PREFIX.match(base)
    parts: dict[str, str] = {}
    extra: list[str] = []
    if m is not None:
        rest, pos = m.group("rest"), 0
        while pos < len(rest):
            if rest[pos] == "_":
                pos += 1
                continue
            t = _NCCL_TOKEN_RE.match(rest, pos)
            if t is not None:
                part, canon = _NCCL_TOKENS[t.group(1).lower()]
                if part in parts:
                    extra.append(canon)
                else:
                    parts[part] = canon
                pos = t.end()
            else:
                end = rest.find("_", pos)
                end = len(rest) if end < 0 else end
                extra.append(rest[pos:end])
                pos = end
    else:
        old = _NCCL_OLD.match(base)
        if old is None or old.group("coll").lower() not in _NCCL_TOKENS:
            return None
        parts["coll"] = _NCCL_TOKENS[old.group("coll").lower()][1]
        if old.group("algo"):
            parts["algo"] = old.group("algo").upper()
            parts["proto"] = (old.group("proto") or "SIMPLE").upper()
        for key in ("op", "type"):
            raw = (old.group(key) or "").lower()
            if raw in _NCCL_TOKENS and _NCCL_TOKENS[raw][0] == key:
                parts[key] = _NCCL_TOKENS[raw][1]
    if "coll" not in parts:
        return None
    if parts["coll"] in _NO_REDUCTION:
        parts.pop("op", None)
        parts.pop("type", None)
    order = [parts.get(k) for k in ("coll", "op", "type", "algo", "proto")]
    return ":".join(["nccl", *(p for p in order if p), *extra])


# -- C++ names -------------------------------------------------------------------------------------------

_OPEN = {"(": ")", "<": ">", "[": "]", "{": "}"}
_CLOSE = {v: k for k, v in _OPEN.items()}


def _strip_params(name: str) -> str:
    """``name`` without its trailing top-level parameter list ``(...)`` (and a trailing ``const``)."""
    s = name[:-len(" const")] if name.endswith(" const") else name
    if not s.endswith(")"):
        return name
    depth = 0
    for i in range(len(s) - 1, -1, -1):
        c = s[i]
        if c in _CLOSE:
            depth += 1
        elif c in _OPEN:
            depth -= 1
            if depth == 0:
                if c != "(" or i == 0:
                    return name
                return s[:i].rstrip()
            if depth < 0:
                return name
    return name


def _drop_inner_signatures(s: str) -> str:
    """Remove parenthesized parameter lists that follow an identifier or ``>`` (enclosing functions of
    lambdas, function types), keeping casts and other groups. Unbalanced text is left as it is."""
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        prev = out[-1][-1:] if out else ""
        if c == "(" and (prev.isalnum() or prev in ("_", ">")) and not "".join(out[-6:]).endswith("lambda"):
            depth, j = 0, i
            while j < n:
                if s[j] == "(":
                    depth += 1
                elif s[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= n:  # unbalanced: keep the rest verbatim
                out.append(s[i:])
                break
            i = j + 1
            if s.startswith(" const", i):
                i += len(" const")
            continue
        out.append(c)
        i += 1
    return "".join(out)


_ANON = re.compile(r"\(anonymous namespace\)::")
_OPERATOR_CALL = re.compile(r"::operator\(\)")
_CALL_TOKEN = "::__argus_call__"
_CAST = re.compile(r"\((?:unsigned |signed )?(?:char|short|int|long|long long|bool)\)(-?\d+)")
_INT_SUFFIX = re.compile(r"\b(\d+)(?:ull|ul|ll|u|l)\b", re.IGNORECASE)
_SPACE_BEFORE_PTR = re.compile(r"\s+([*&])")
_COMMA = re.compile(r"\s*,\s*")
_CLOSE_SPACE = re.compile(r">\s+>")


def _cxx(name: str) -> str:
    s = name[5:] if name.startswith("void ") else name
    s = _strip_params(s)
    s = _ANON.sub("", s)
    s = _OPERATOR_CALL.sub(_CALL_TOKEN, s)
    s = _CAST.sub(r"\1", s)
    s = _drop_inner_signatures(s)
    s = s.replace(_CALL_TOKEN, "")
    s = _INT_SUFFIX.sub(r"\1", s)
    s = _SPACE_BEFORE_PTR.sub(r"\1", s)
    s = _COMMA.sub(", ", s)
    while True:
        t = _CLOSE_SPACE.sub(">>", s)
        if t == s:
            break
        s = t
    for old, new in RENAMES.items():
        if s.startswith(old):
            s = new + s[len(old):]
    return s.strip()


# -- entry point -----------------------------------------------------------------------------------------


def _is_final(s: str) -> bool:
    return s.startswith(("nccl:", "memcpy:")) or s == "memset" or s == "<unnamed>" or bool(_HASHED.search(s))


def _cap(s: str) -> str:
    if len(s) <= MAX_LEN:
        return s
    digest = hashlib.sha1(s.encode("utf-8", "replace")).hexdigest()[:12]
    return s[:MAX_LEN - 13] + "~" + digest


def _once(raw: str) -> str:
    s = _SPACES.sub(" ", raw).strip()
    if not s:
        return "<unnamed>"
    if _is_final(s):
        return s
    s = _SPACES.sub(" ", demangle(s)).strip()
    m = _MEMCPY.match(s)
    if m is not None:
        return "memcpy:" + _COPY_BY_LOWER.get(m.group(1).lower(), m.group(1))
    if _MEMSET.match(s):
        return "memset"
    base = _strip_params(s[5:] if s.startswith("void ") else s)
    nccl = _nccl(base)
    if nccl is not None:
        return _cap(nccl)
    out = _cxx(s) or s
    return _cap(out)


@lru_cache(maxsize=65_536)
def normalize(name: str) -> str:
    """The normalized name of a kernel (see the module docstring for the rules); idempotent, never raises."""
    try:
        out = _once(name)
        # The rules are written to be idempotent; applying them until nothing changes guards odd inputs.
        for _ in range(4):
            again = _once(out)
            if again == out:
                return out
            out = again
        return out
    except Exception:  # a name must never break the parser thread
        log.exception("kernel name normalization failed for %r", name[:200])
        return _cap(_SPACES.sub(" ", name).strip() or "<unnamed>")
