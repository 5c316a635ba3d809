"""A party's feature matrix, read from its own store once per flow run.

More: docs/protocols/vertical-lr.md (the feature cache, and why).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from prefect.runtime import flow_run

from core.preprocessing import FittedPreprocessing, PreprocessingSpec, fit_local
from storage.descriptor import TableRef
from storage.party_store import PartyStore

_MAX_ENTRIES = 4  # a process plays at most a few parties in one run (guest, hosts)


@dataclass(frozen=True)
class PartyFeatures:
    """A party's features (read-only, preprocessed and clipped when asked), their names, its
    labels and ids, and the fitted preprocessing (None: the stored values as they are)."""

    X: np.ndarray
    names: tuple[str, ...]
    labels: np.ndarray | None
    ids: np.ndarray
    preprocessing: FittedPreprocessing | None = None


# the table's descriptor (its database's path resolved), clip, preprocessing, flow run id
_CacheKey = tuple[TableRef, float | None, PreprocessingSpec | None, str]
_cache: OrderedDict[_CacheKey, PartyFeatures] = OrderedDict()
_lock = threading.Lock()


def party_features(
    ref: TableRef,
    clip: float | None,
    frame: pd.DataFrame | None = None,
    preprocessing: PreprocessingSpec | None = None,
) -> PartyFeatures:
    """``ref``'s features, preprocessed with statistics of its own columns when
    ``preprocessing`` is given (imputed, scaled: nothing leaves the party) and then clipped to
    [-clip, clip] (None: as stored), cached for the flow run.

    ``frame`` is the validated table the caller has just read in this run (the set-up check),
    which then fills the cache instead of a second read."""
    run = flow_run.get_id()
    if run is None:
        return _read(ref, clip, frame, preprocessing)
    key = (replace(ref, database=str(ref.path.resolve())), clip, preprocessing, str(run))
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    features = _read(ref, clip, frame, preprocessing)
    with _lock:
        _cache[key] = features
        while len(_cache) > _MAX_ENTRIES:
            _cache.popitem(last=False)
    return features


def clear() -> None:
    """Forget every cached matrix (a party process that wants its memory back)."""
    with _lock:
        _cache.clear()


def _read(
    ref: TableRef,
    clip: float | None,
    frame: pd.DataFrame | None,
    preprocessing: PreprocessingSpec | None = None,
) -> PartyFeatures:
    if frame is None:
        frame = PartyStore.of(ref).read_table(ref, allow_missing=preprocessing is not None)
    names = tuple(c for c in frame.columns if c not in (ref.id_column, ref.label_column))
    labels = frame[ref.label_column].to_numpy() if ref.label_column else None
    X = frame[list(names)].to_numpy(dtype=float)
    fitted = None
    if preprocessing is not None:
        fitted = fit_local(X, names, preprocessing)
        X = fitted.transform(X, f"party {ref.party}, table {ref.table!r}")
        names = tuple(fitted.output_names)
    if clip is not None:
        X = np.clip(X, -clip, clip)
    ids = frame[ref.id_column].to_numpy(copy=True)
    X.flags.writeable = False  # shared by every step of the run: nobody may change it
    for column in (labels, ids):
        if column is not None:
            column.flags.writeable = False
    return PartyFeatures(X, names, labels, ids, fitted)
