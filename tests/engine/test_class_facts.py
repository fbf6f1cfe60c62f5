"""`class_fact`: a fact of a class is worked out once per class and arguments, and never keeps a class alive."""

import gc
import weakref

from streamwise.runtime.engine.class_facts import class_fact


def test_a_fact_is_worked_out_once_per_class_and_arguments():
    calls = []

    @class_fact
    def named(cls: type, suffix: str = "") -> str:
        calls.append((cls, suffix))
        return cls.__name__ + suffix

    class A: ...
    class B: ...

    assert [named(A), named(A), named(B), named(A, "!"), named(A, "!")] == ["A", "A", "B", "A!", "A!"]
    assert calls == [(A, ""), (B, ""), (A, "!")]


def test_a_dropped_class_is_not_kept():
    @class_fact
    def bases(cls: type) -> int:
        return len(cls.__mro__)

    made = type("Made", (), {})
    assert bases(made) == 2
    gone = weakref.ref(made)
    del made
    gc.collect()
    assert gone() is None
