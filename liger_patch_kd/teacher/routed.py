"""Offline data from several teachers: one store per teacher, each holding its teacher's top-k on the rows routed
to it, read as one dataset whose rows say which teacher they came from (a `teacher` column).

Each row's top-k is already its own teacher's, so the rows train as any offline data does (KDTrainer without a
teacher_model); the column names the source. Mixtures over several teachers' top-k are not offered: each top-k's
tail is unknown, so their mixture is not determined by them.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

__all__ = ["RoutedTeacherData"]


class RoutedTeacherData:
    """The rows of `stores` ({name: TeacherLogprobsDataset or any dataset of offline rows}), in that order, each
    with "teacher": its store's name. Stores must share one top-k (rows of one batch are padded to one K)."""

    def __init__(self, stores: Mapping[str, Any]) -> None:
        if not stores or not all(isinstance(name, str) and name for name in stores):
            raise ValueError(
                f"RoutedTeacherData needs {{teacher name: store}} with non-empty str names; got {stores!r}"
            )
        top_ks = {name: getattr(store, "top_k", None) for name, store in stores.items()}
        if len({k for k in top_ks.values() if k is not None}) > 1:
            raise ValueError(
                f"the stores hold different top-k sizes {top_ks}; rows of one batch share one K: precompute every "
                f"teacher with the same top_k"
            )
        self.names = list(stores)
        self.stores = [stores[name] for name in self.names]
        self.starts = [0]
        for store in self.stores:
            self.starts.append(self.starts[-1] + len(store))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = bisect.bisect_right(self.starts, i) - 1
        return {**self.stores[j][i - self.starts[j]], "teacher": self.names[j]}
