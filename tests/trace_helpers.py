"""Counting the traces of a jitted library body through its public wrapper."""

from __future__ import annotations


def count_calls(monkeypatch, module, name: str) -> list:
    """Replaces ``module.name`` by a pass-through that appends to the returned list per call.

    A callee that the jitted body calls once per trace (and nowhere else) then counts that
    body's traces: a call through the public wrapper that hits the compiled program adds none.
    """
    calls: list = []
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
