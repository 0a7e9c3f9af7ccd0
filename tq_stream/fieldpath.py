"""Field paths: nested TensorDict fields stored as flat fields named ``"obs.image"``.

A put of ``{"obs": {"image": ..., "state": ...}}`` (a nested TensorDict, or a dict of
fields inside a batch dict) stores the fields ``"obs.image"`` and ``"obs.state"``;
reading fields whose names hold a ``"."`` builds the nested TensorDict again. A
dotted name written flat (``{"obs.image": ...}``) is the same field. Two names
collide when one is a path prefix of the other (``"obs"`` and ``"obs.image"``: the
first would be a tensor and a TensorDict at once); that is a SchemaError in one
put, and the controller refuses a new field that collides with a partition's
existing one. A read may name a parent (``"obs"``): it stands for every field
under it (``resolve``), and the reader gets the subtree.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from tq_stream.errors import SchemaError

SEP = "."


def join(parts: Iterable[str]) -> str:
    return SEP.join(parts)


def check_path(name: str) -> str:
    """Return ``name`` if no segment of it is empty (``"a..b"``, ``".a"``, ``"a."``)."""
    if SEP in name and not all(name.split(SEP)):
        raise SchemaError(f"field name must not have an empty segment between '{SEP}'s "
                          f"(they join nested keys), got {name!r}")
    return name


def check_paths(names: Iterable[str], existing: Iterable[str] = ()) -> None:
    """Raise SchemaError if a name of ``names`` is a path prefix of another name of
    ``names`` or ``existing`` (or has one there).

    ``existing`` names are assumed not to collide among themselves.
    """
    new = set(names)
    every = new | set(existing)
    for name in new:
        parts = name.split(SEP)
        for i in range(1, len(parts)):
            prefix = join(parts[:i])
            if prefix in every:
                raise SchemaError(
                    f"field {name!r} collides with field {prefix!r}: a field cannot be "
                    f"a value and hold nested fields at once")
    if existing:
        for other in set(existing) - new:
            parts = other.split(SEP)
            for i in range(1, len(parts)):
                if join(parts[:i]) in new:
                    raise SchemaError(
                        f"field {join(parts[:i])!r} collides with field {other!r}: a "
                        f"field cannot be a value and hold nested fields at once")


def under(name: str, fields: Iterable[str]) -> list[str]:
    """The fields of ``fields`` at or below path ``name`` (``"obs"`` ->
    ``["obs.image", "obs.state"]``), in the order of ``fields``."""
    prefix = name + SEP
    return [f for f in fields if f == name or f.startswith(prefix)]


def resolve(names: Iterable[str], fields: Collection[str]) -> list[str]:
    """``names`` with each parent path replaced by the fields of ``fields`` below it; a
    name that is a field, or names nothing in ``fields``, stays as it is (the caller
    reports it). No name comes twice."""
    out: list[str] = []
    for name in names:
        below = [name] if name in fields else under(name, fields) or [name]
        out += [f for f in below if f not in out]
    return out
