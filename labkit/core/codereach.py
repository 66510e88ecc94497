"""What a function's code reaches: the globals, closure cells and defaults it loads, followed into the helpers
defined beside it, and the attribute names it reads. The reading behind :func:`labkit.core.grading.check_own_code`
(an answer calls no labkit and no library function the exercise is about) and the board's library check.

- :func:`first_reached`: the first name by which a function reaches an object a predicate picks (or reads an
  attribute of a given name); ``unfold``: modules read through the attribute chains the code takes of them
  (:func:`unfolded`: ``lk.fp8cast.exact`` stands for ``labkit.fp8.cast.exact``, not for all of labkit).
- :func:`is_labkit`: a labkit module, function or class. :func:`loaded_globals`, :func:`attributes_read`,
  :func:`names` (the identifiers of a source, comments and strings left out).

Used by: :mod:`labkit.core.grading`, :mod:`labkit.tritonlab.compile`, :mod:`labkit.board.worker`.
"""
from __future__ import annotations

import dis
import inspect
import io
import re
import textwrap
import tokenize
from typing import Callable


def is_labkit(obj) -> bool:
    """A labkit module, or a function, method or class defined in labkit (instances do not count)."""
    if inspect.ismodule(obj):
        module = obj.__name__
    elif inspect.isroutine(obj) or inspect.isclass(obj):
        module = getattr(getattr(obj, "__func__", obj), "__module__", None) or ""
    else:
        return False
    return module == "labkit" or module.startswith("labkit.")


def first_reached(fn: Callable, matches: Callable[[object], bool], *, attributes: set[str] = frozenset(),
                  unfold: Callable[[object], bool] | None = None, seen: set | None = None) -> str | None:
    """The name by which ``fn`` reaches an object for which ``matches`` is true, or reads an attribute
    named in ``attributes`` (``torch.softmax``, ``x.softmax``); None if it does neither.

    Follows the globals its code loads (``LOAD_GLOBAL``/``LOAD_NAME``, nested code included:
    attribute names such as ``x.shape`` are not globals), its closure cells and defaults, and
    recurses into plain functions defined in ``fn``'s own module (a helper in another notebook cell).
    A global for which ``unfold`` is true counts as what the code takes of it (:func:`unfolded`)."""
    fn = getattr(fn, "__func__", fn)  # bound and static methods
    seen = set() if seen is None else seen
    if not inspect.isfunction(fn) or fn in seen:
        return None
    seen.add(fn)
    read = attributes_read(fn) & set(attributes)
    if read:
        return f".{sorted(read)[0]}"
    found = unfolded(fn, loaded_globals(fn), unfold) if unfold else loaded_globals(fn)
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            found[fn.__code__.co_freevars[i]] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    defaults = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    found.update({f"<default {i}>": value for i, value in enumerate(defaults)})
    for label, obj in found.items():
        if matches(obj):
            return label
        if inspect.isfunction(obj) and obj.__module__ == fn.__module__:
            inner = first_reached(obj, matches, attributes=attributes, unfold=unfold, seen=seen)
            if inner:
                return f"{label} -> {inner}"
    return None


def unfolded(fn: Callable, found: dict, unfold: Callable[[object], bool]) -> dict:
    """``found`` (name -> a global of ``fn``) with each global for which ``unfold`` is true replaced by what the code
    takes of it: label -> object for each attribute chain read off it (``lk.fp8cast.exact`` -> that function),
    followed while ``unfold`` holds; a bare use (``getattr(lk, name)``, ``m = lk``) is the global itself."""
    out = {name: value for name, value in found.items() if not unfold(value)}
    for code in code_objects(fn):
        ins = list(dis.get_instructions(code))
        for i, op in enumerate(ins):
            if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or op.argval not in found or not unfold(found[op.argval]):
                continue
            label, obj = op.argval, found[op.argval]
            for nxt in ins[i + 1:]:
                if nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD") or not unfold(obj):
                    break
                label, obj = f"{label}.{nxt.argval}", getattr(obj, nxt.argval, None)
            out[label] = obj
    return out


def code_objects(fn: Callable) -> list:
    """``fn``'s code object and every code object nested in it (lambdas, comprehensions, inner defs)."""
    codes, todo = [], [fn.__code__]
    while todo:
        code = todo.pop()
        codes.append(code)
        todo += [c for c in code.co_consts if inspect.iscode(c)]
    return codes


def loaded_globals(fn: Callable) -> dict:
    """The globals ``fn``'s code (nested code included) reads, by name, with their current values."""
    return {ins.argval: fn.__globals__[ins.argval] for code in code_objects(fn) for ins in dis.get_instructions(code)
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in fn.__globals__}


def attributes_read(fn: Callable) -> set[str]:
    """Attribute names ``fn``'s code reads (``x.softmax``, ``torch.nn.functional.layer_norm``, and
    ``from torch.nn.functional import layer_norm as ln`` inside ``fn``)."""
    return {ins.argval for code in code_objects(fn) for ins in dis.get_instructions(code)
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM")}


def names(source: str) -> set[str]:
    """Identifiers in ``source``, plus "labkit" for a string literal that names a labkit module
    (``__import__("labkit.perf.memory")``); comments, other strings and names such as ``q_blk`` do
    not count as lk."""
    found = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
            if tok.type == tokenize.NAME:
                found.add(tok.string)
            elif tok.type == tokenize.STRING and re.fullmatch(r"[rbuRBU]*(['\"])labkit(\.\w+)*\1", tok.string):
                found.add("labkit")
    except (tokenize.TokenError, IndentationError):  # e.g. a lambda cut out of a longer line
        pass
    return found
