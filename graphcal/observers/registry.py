"""Observers by name: the registry lookup every caller uses, with one-line usage errors."""

from __future__ import annotations

from compressed_tensors.registry import registered_names

from graphcal.errors import UsageError
from graphcal.observers.base import Observer


def make_observer(name: str, base_name: str, args):
    """An observer from the registry; unknown names and bad kwargs become one-line usage errors."""
    try:
        return Observer.load_from_registry(name, base_name=base_name, args=args)
    except KeyError:
        known = ", ".join(n.replace("-", "_") for n in registered_names(Observer))
        raise UsageError(f"unknown observer {name!r}; choose one of: {known}") from None
    except (ValueError, TypeError) as e:
        raise UsageError(f"{e} (for the {base_name} observer)") from e
