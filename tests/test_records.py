"""``quick``: a frozen dataclass built through its slots behaves as the dataclass's own ``__init__`` builds it."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from rematd.planner import ModeSeconds, Shape, StepObservation
from rematd.planner.messages import StepStats
from rematd.planner.records import quick

calls: list[str] = []


def _spec(name: str) -> type:
    @dataclass(frozen=True, slots=True)
    class Record:
        first: int
        second: str = "two"
        items: tuple[int, ...] = ()
        listed: list[int] = field(default_factory=list)
        hidden: int = field(default=7, init=False)
        late: float = field(default=0.5, kw_only=True)
        needed: int = field(kw_only=True, default=0)

        def __post_init__(self) -> None:
            calls.append(name)
            if self.first < 0:
                raise ValueError(f"first must be non-negative, got {self.first}")

    Record.__qualname__ = name
    return Record


Plain = _spec("Plain")
Quick = quick(_spec("Quick"))


def test_the_signature_and_the_records_are_the_dataclasses_own() -> None:
    assert str(inspect.signature(Quick)) == str(inspect.signature(Plain))
    for args, kwargs in [((1,), {}), ((1, "b", (2,), [3]), {"late": 2.0, "needed": 4}), ((), {"first": 5})]:
        a, b = Plain(*args, **kwargs), Quick(*args, **kwargs)
        assert [getattr(a, f.name) for f in dataclasses.fields(a)] == [
            getattr(b, f.name) for f in dataclasses.fields(b)
        ]
    calls.clear()
    Quick(3)
    assert calls == ["Quick"], "__post_init__ runs once"


def test_defaults_from_factories_are_fresh_and_errors_are_the_same() -> None:
    one, two = Quick(1), Quick(1)
    assert one.listed == [] and one.listed is not two.listed
    for args, kwargs in [((), {}), ((1, "b", (), [], 0.5), {}), ((1,), {"hidden": 3}), ((1,), {"nope": 1})]:
        with pytest.raises(TypeError) as plain:
            Plain(*args, **kwargs)
        with pytest.raises(TypeError) as fast:
            Quick(*args, **kwargs)
        assert str(plain.value).split("() ")[1] == str(fast.value).split("() ")[1]
    with pytest.raises(ValueError, match="first must be non-negative"):
        Quick(-1)


def test_still_frozen_equal_hashable_replaceable_and_picklable() -> None:
    record = Quick(1, "b", (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.first = 2  # type: ignore[misc]
    assert dataclasses.replace(record, first=2).first == 2 and dataclasses.replace(record, first=2).second == "b"
    step = StepStats(step=3, shape=Shape(batch=2, seq_len=8, tokens=16), budget_bytes=10, thread_seconds=0.5)
    assert pickle.loads(pickle.dumps(step)) == step
    assert hash(Shape(batch=2, seq_len=8, tokens=16)) == hash(step.shape)
    assert dataclasses.replace(step, steps=2).steps == 2 and dataclasses.replace(step, steps=2).budget_bytes == 10


def test_the_step_paths_records_check_what_they_checked() -> None:
    with pytest.raises(ValueError, match=r"mode_seconds\.seconds"):
        ModeSeconds(mode=1, blocks=1, seconds=-1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StepStats()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        StepObservation(step=1, peak_bytes=1)  # type: ignore[call-arg]


def test_only_frozen_dataclasses_with_slots_are_taken() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        x: int = 0

    @dataclass(slots=True)
    class Mutable:
        x: int = 0

    for cls in (NoSlots, Mutable, int):
        with pytest.raises(TypeError, match="frozen dataclass with slots"):
            quick(cls)

    @dataclass(frozen=True, slots=True)
    class InitOnly:
        x: int = 0
        scale: dataclasses.InitVar[int] = 1

        def __post_init__(self, scale: int) -> None:
            pass

    with pytest.raises(TypeError, match="init-only variables"):
        quick(InitOnly)
