"""Score and mask mods as the forward kernel compiles them (flex attention's functions).

A mod is a plain Python function with torch's flex-attention signature,

    score_mod(score, b, h, q_idx, kv_idx) -> score      mask_mod(b, h, q_idx, kv_idx) -> bool

that the kernel calls while it is traced (kernels/common/mask.apply_mods): the score arrives as a
CuTe DSL Float32 (softmax_scale * q k^T), the indices as Int32 (h: the query head), and the
operators build device code, inlined on S in registers. The same function runs on torch tensors
(fa3.flex's reference), so a mod must not branch on its arguments (`if score > 0` cannot be traced;
write arithmetic, or fa3.flex's helpers, which take either kind of value).

What a mod reads besides its arguments it captures in its closure:
    tensors (a bias table, document ids): become kernel arguments, read in the kernel by indexing
        (`bias[h, kv_idx - q_idx]`); their values are runtime data, their dtypes and ranks part of
        the compile key;
    Python numbers, strings, None (a window size, a cap): compile-time constants, part of the key
        (a new value compiles a new kernel: pass a one-element tensor to keep one a runtime value);
    other mods (a mask built from two masks): walked the same way.
Captured tensors are found through the closure (`fn.__closure__`), as torch's closures capture them,
so that one function serves both fa3 and torch.nn.attention.flex_attention; a tensor read as a
module global instead is refused with its name.

The compile key of a mod is its identity as code: its qualified name, its bytecode, constants and
names (nested functions' too), and its closure's constants and captured tensors' dtypes and ranks,
never their values.

The backward recomputes the modded scores and needs the score mod's derivative, which a traced
function cannot give: a score mod carries it as an attribute, `score_mod.score_mod_grad`,

    a number     d score_mod / d score where it is constant (1.0 for a bias added to the score);
    a function   grad(out, b, h, q_idx, kv_idx) -> d score_mod / d score, of the mod's *output*
                 `out` (the backward recovers it from P and the LSE, so that no register keeps the
                 input score): softcap's is 1 - (out / cap)^2,

compiled as a mod is (its captures are kernel arguments too). fa3.flex's score mods carry theirs;
a score mod without one is refused when its backward runs (`score_mod_grad`). Mask mods need
nothing: the backward applies them as the forward did. Captured tensors get no gradient.
"""

from __future__ import annotations

import types

import torch

# the dtypes a captured tensor may have (what the kernel can index and load)
AUX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int16,
              torch.int8, torch.uint8)
_CONSTANTS = (int, float, bool, str, type(None))


class ModSource:
    """One mod, walked once: `key` (what identifies its compiled code), `tensors` (its captured
    tensors in closure order, with their names) and `bind(aux)`, the function with those tensors
    replaced by the kernel's arguments aux[offset:offset + len(tensors)]."""

    def __init__(self, fn, kind: str, offset: int = 0):
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"{kind} must be a Python function (a def or a lambda) with torch's "
                            f"signature, got {type(fn).__name__}")
        arity = 4 if kind == "mask_mod" else 5
        if fn.__code__.co_argcount != arity:
            expected = {"score_mod": "(score, b, h, q_idx, kv_idx)", "mask_mod": "(b, h, q_idx, kv_idx)",
                        "score_mod_grad": "(out, b, h, q_idx, kv_idx)"}[kind]
            raise TypeError(f"{kind} {_name(fn)} takes {fn.__code__.co_argcount} arguments; it must take "
                            f"{expected}")
        self.fn, self.kind, self.offset = fn, kind, offset
        self.name = _name(fn)
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.key = (kind, self._walk(fn))

    def _walk(self, fn) -> tuple:
        code = fn.__code__
        for name in code.co_names:
            if isinstance(fn.__globals__.get(name), torch.Tensor):
                raise ValueError(f"{self.kind} {self.name} reads the global tensor {name!r}: capture it "
                                 f"in a closure (a function that returns the mod), so that the kernel "
                                 f"takes it as an argument")
        if fn.__defaults__ and any(not isinstance(d, _CONSTANTS) for d in fn.__defaults__):
            raise ValueError(f"{self.kind} {self.name}: default arguments must be numbers")
        cells = []
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            cells.append(self._captured(var, cell.cell_contents))
        return (fn.__module__, fn.__qualname__, _code_key(code), fn.__defaults__, tuple(cells))

    def _captured(self, var: str, value):
        if isinstance(value, torch.Tensor):
            if value.dtype not in AUX_DTYPES:
                raise ValueError(f"{self.kind} {self.name} captures {var!r} of dtype {value.dtype}; "
                                 f"captured tensors must be one of {', '.join(map(str, AUX_DTYPES))}")
            if value.dim() == 0:
                raise ValueError(f"{self.kind} {self.name} captures {var!r}, a 0-dim tensor: capture a "
                                 f"Python number (compiled in) or a 1-element tensor read as {var}[0]")
            self.tensors.append((var, value))
            return ("tensor", str(value.dtype), value.dim())
        if isinstance(value, types.FunctionType):
            return ("fn", self._walk(value))
        if isinstance(value, _CONSTANTS):
            return ("const", type(value).__name__, value)
        if isinstance(value, tuple) and all(isinstance(v, _CONSTANTS) for v in value):
            return ("const", "tuple", value)
        raise ValueError(f"{self.kind} {self.name} captures {var!r} of type {type(value).__name__}: "
                         f"a mod may capture tensors, Python numbers or other mods")

    def bind(self, aux: tuple):
        """The mod with its captured tensors replaced by aux[offset:] in closure order (called by
        the kernel while it is traced)."""
        it = iter(aux[self.offset:self.offset + len(self.tensors)])
        return _rebuild(self.fn, it)

    def check_tensors(self, device) -> list[torch.Tensor]:
        """The captured tensors as the kernel takes them (contiguous), checked against `device`."""
        out = []
        for var, t in self.tensors:
            if t.device != device:
                raise ValueError(f"{self.kind} {self.name} captures {var!r} on {t.device}, but q is on "
                                 f"{device}: move it to q's device")
            if t.requires_grad and torch.is_grad_enabled():
                raise NotImplementedError(f"{self.kind} {self.name} captures {var!r}, which requires grad: "
                                          f"fa3 differentiates q, k and v only, not a mod's captured tensors "
                                          f"(detach it, or compute under torch.no_grad())")
            out.append(t.contiguous())
        return out


def score_mod_grad(score_mod):
    """The derivative a score mod carries for the backward (the module docstring): a float, or the
    function `score_mod.score_mod_grad`; a mod without one is refused, naming what to provide."""
    grad = getattr(score_mod, "score_mod_grad", None)
    name = _name(score_mod)
    if grad is None:
        raise NotImplementedError(
            f"score_mod {name} has no derivative for the backward: set {name}.score_mod_grad to "
            f"d score_mod / d score, a number where it is constant (1.0 for a bias added to the score) or a "
            f"function (out, b, h, q_idx, kv_idx) of the mod's output score (softcap's: 1 - (out / cap)**2); "
            f"fa3.flex's score mods carry theirs")
    if isinstance(grad, (int, float)) and not isinstance(grad, bool):
        return float(grad)
    if not isinstance(grad, types.FunctionType):
        raise TypeError(f"score_mod {name}'s score_mod_grad must be a number or a Python function "
                        f"(out, b, h, q_idx, kv_idx), got {type(grad).__name__}")
    return grad


class Mods:
    """A call's score and mask mods (either may be None): their joint compile `key`, and the
    tensors they capture, score mod's first (the kernel's `aux` tuple). `backward`: the backward's,
    with the score mod's derivative (`score_mod_grad`: None where there is no score mod, a float,
    or a ModSource whose tensors follow the mask mod's)."""

    def __init__(self, score_mod=None, mask_mod=None, backward: bool = False):
        self.score_mod = None if score_mod is None else ModSource(score_mod, "score_mod")
        offset = len(self.score_mod.tensors) if self.score_mod else 0
        self.mask_mod = None if mask_mod is None else ModSource(mask_mod, "mask_mod", offset)
        self.key = (self.score_mod.key if self.score_mod else None,
                    self.mask_mod.key if self.mask_mod else None)
        self.score_mod_grad = None
        if backward:
            if score_mod is not None:
                grad = score_mod_grad(score_mod)
                if isinstance(grad, float):
                    self.score_mod_grad = grad
                else:
                    offset += len(self.mask_mod.tensors) if self.mask_mod else 0
                    self.score_mod_grad = ModSource(grad, "score_mod_grad", offset)
            grad_key = getattr(self.score_mod_grad, "key", self.score_mod_grad)
            self.key = (*self.key, ("backward", grad_key))

    @property
    def sources(self):
        return [m for m in (self.score_mod, self.mask_mod, self.score_mod_grad) if isinstance(m, ModSource)]

    def aux_spec(self) -> list[tuple[torch.dtype, int]]:
        """(dtype, rank) of each captured tensor, in the kernel's order: its fake signature."""
        return [(t.dtype, t.dim()) for m in self.sources for _, t in m.tensors]

    def compile_error(self, error: Exception) -> str:
        """The message for mods the kernel could not be compiled with: the mods by name, what they
        capture (a tensor indexed with a number of indices other than its rank is the common cause:
        the DSL reports it as a coordinate not "weakly congruent" to the layout), and the DSL's error."""
        names = " and ".join(f"{m.kind} {m.name}" for m in self.sources)
        captured = ", ".join(f"{var!r} {tuple(t.shape)} {t.dtype}" for m in self.sources for var, t in m.tensors)
        hint = ""
        if "weakly congruent" in str(error):
            hint = (" (an index into a captured tensor has a number of coordinates other than its rank: "
                    "index each with one coordinate per dimension)")
        return (f"{names} could not be compiled into the attention kernel{hint}; captured tensors: "
                f"{captured or 'none'}. The compiler said: {error}")

    def aux(self, device) -> tuple:
        return tuple(t for m in self.sources for t in m.check_tensors(device))


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _code_key(code: types.CodeType) -> tuple:
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_argcount)


def _rebuild(fn, tensors):
    """fn with a fresh closure: captured tensors taken from `tensors` in order, captured functions
    rebuilt the same way, everything else as it is."""
    if not fn.__closure__:
        return fn
    cells = []
    for cell in fn.__closure__:
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            value = next(tensors)
        elif isinstance(value, types.FunctionType):
            value = _rebuild(value, tensors)
        cells.append(types.CellType(value))
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
