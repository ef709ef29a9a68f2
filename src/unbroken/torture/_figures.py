"""The crash torture's figures: `Figures`, the tally of kills, recoveries and checks that a
run reports (and whose `ok` decides PASS), with `KINDS`, the kill kinds it counts. Kept apart
from `crash` so the driver module stays small; `crash` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("op", "timer", "point")


@dataclass
class Figures:
    seed: int
    kills_requested: int
    kills: int = 0
    kills_by_kind: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    kills_by_phase: dict[str, int] = field(default_factory=dict)
    lives: int = 0
    recoveries: int = 0
    restored_from_nothing: int = 0
    fell_back: int = 0
    torn_seen: int = 0
    torn_refused: int = 0
    corrupt_seen: int = 0
    corrupt_refused: int = 0
    staging_debris_seen: int = 0
    trash_debris_seen: int = 0
    generations_reported: int = 0
    generations_lost: int = 0
    rots: int = 0  # a newer generation rotted between lives (one byte of tensor data)
    rots_refused: int = 0  # ... and the next life did not load it
    rots_only_generation: int = 0  # ... it was the only verified one: the run was refused
    no_restore_starts: int = 0  # lives that tried to save without restore() in a used folder
    no_restore_refused: int = 0  # ... and got RunNotRestored
    no_restore_changed: int = 0  # ... and changed the folder anyway
    aside_explained: int = 0  # aside/ entries: a rot's or a restore's refusal
    aside_unexplained: int = 0
    torn_or_corrupt_loaded: int = 0
    wrong_state_restored: int = 0
    async_save: str = "off"
    persist_share: float | None = None
    # async saves: kills right after save() returned ("step-done" at a save step), and how
    # many of those generations were committed all the same (by the persisting process)
    kills_after_save_returned: int = 0
    committed_after_save_returned: int = 0
    # any kill while a save was handed over and not yet confirmed, and how many committed
    kills_in_flight: int = 0
    committed_in_flight: int = 0
    episodes: int = 0
    episodes_equal: int = 0
    final_equal: bool = False
    reference_ops: int = 0
    reference_seconds: float = 0.0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    kills_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.failures and self.generations_lost == 0 and self.final_equal
                and self.torn_or_corrupt_loaded == 0 and self.wrong_state_restored == 0
                and self.kills >= self.kills_requested and self.recoveries == self.kills
                and self.torn_refused == self.torn_seen
                and self.corrupt_refused == self.corrupt_seen
                and self.rots_refused == self.rots and self.no_restore_changed == 0
                and self.no_restore_refused == self.no_restore_starts
                and self.aside_unexplained == 0)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["ok"] = self.ok
        return d
