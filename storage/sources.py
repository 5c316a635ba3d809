"""Reading a data owner's source file (CSV, gzipped CSV, Parquet) into a frame.

A file that cannot be read is refused with one line that names it and says what to do (the
owner fixes the file, not the code), before the database is opened. A CSV line with more or
fewer fields than the header is refused too: pandas would fail on some (a later line with more
fields), read others as missing cells (fewer fields), and shift every column under the header
when the first data line has one field more (it becomes the index).
"""

from __future__ import annotations

import csv
import gzip
import io
import zlib
from collections.abc import Iterator, Mapping
from contextlib import closing
from pathlib import Path
from typing import Any, BinaryIO

import pandas as pd

from core.job_checks import SourceShape, entries, entry_party, entry_problems
from storage.validation import DataValidationError

CSV_SUFFIXES = (".csv", ".csv.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")


def read_source(source: str | Path, table: str) -> pd.DataFrame:
    """The rows of ``source`` for ``table``; a file that cannot be read raises
    :class:`DataValidationError` naming the file (no column, no row)."""
    path = _readable(Path(source), table)
    name = path.name.lower()
    frame = (
        _read_parquet(path, table) if name.endswith(PARQUET_SUFFIXES) else _read_csv(path, table)
    )
    if len(frame) == 0:
        raise _file_error(table, path, "the file has a header but no rows; export the data again")
    return frame


def source_shape(source: str | Path, table: str) -> SourceShape:
    """The header and row count of ``source``, read without loading its values (what
    ``core.job_checks`` needs); a file that cannot be read is refused as by :func:`read_source`."""
    path = _readable(Path(source), table)
    if path.name.lower().endswith(PARQUET_SUFFIXES):
        try:
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
        except (ValueError, OSError) as error:
            raise _file_error(table, path, f"not a readable Parquet file ({error})") from None
        return SourceShape(tuple(meta.schema.names), meta.num_rows)
    try:
        with _open(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as text:
            reader = csv.reader(text)
            header = next(reader, [])
            rows = sum(1 for record in reader if record)
    except UnicodeDecodeError:
        raise _not_utf8(path, table) from None
    except (gzip.BadGzipFile, EOFError, zlib.error, csv.Error) as error:
        raise _file_error(table, path, f"not readable as CSV ({error})") from None
    if not header:
        raise _file_error(table, path, "the file is empty (no header line); export the data again")
    return SourceShape(tuple(header), rows)


def sources_problems(
    job: Any, sources: Mapping[str, Path], shown_from: Path | None = None
) -> list[str]:
    """Every problem ``core.job_checks`` finds in the entries ``sources`` maps to their files
    (the checks a side runs after the terms are agreed, and ``privreg job check``): a file that
    cannot be read is one problem, naming its party and entry. ``shown_from``: a column's or a
    size's problem names its file relative to that folder (as the job file writes it)."""
    problems = []
    for key, source in sources.items():
        entry = entries(job)[key]
        try:
            shape = source_shape(source, entry.table.table)
        except (DataValidationError, ValueError) as error:
            problems.append(f"party {entry_party(entry)} ({key}): {error}")
            continue
        shown = source.relative_to(shown_from) if shown_from is not None else source
        problems += entry_problems(job, key, shape, shown)
    return problems


def _readable(path: Path, table: str) -> Path:
    """``path`` if it names a non-empty file of a kind privreg imports, else the refusal."""
    if not path.name.lower().endswith(CSV_SUFFIXES + PARQUET_SUFFIXES):
        raise ValueError(f"{path.name}: only .csv, .csv.gz and .parquet files are imported")
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "no such file; check the path"
        raise _file_error(table, path, problem)
    if path.stat().st_size == 0:
        raise _file_error(table, path, "the file is empty (0 bytes); export the data again")
    return path


def _file_error(table: str, path: Path, problem: str) -> DataValidationError:
    return DataValidationError(table, None, None, f"file {path}: {problem}")


def _read_parquet(path: Path, table: str) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except (ValueError, OSError) as error:  # pyarrow's ArrowInvalid is a ValueError
        detail = " ".join(str(error).split())
        raise _file_error(
            table, path, f"not a readable Parquet file ({detail}); export it again"
        ) from None


def _read_csv(path: Path, table: str) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except UnicodeDecodeError:
        raise _not_utf8(path, table) from None
    except pd.errors.EmptyDataError:
        raise _file_error(
            table, path, "the file is empty (no header line); export the data again"
        ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise _file_error(
            table, path, "not a complete gzip file; compress it again, or name it .csv"
        ) from None
    except pd.errors.ParserError as error:
        raise _ragged(path, table) or _file_error(
            table, path, f"not readable as CSV ({' '.join(str(error).split())}); check its quoting"
        ) from None
    # a short line leaves the last column empty, a long first line makes an index: only then
    # is the file read a second time, line by line, to find it
    suspect = not frame.index.equals(pd.RangeIndex(len(frame))) or frame.iloc[:, -1].isna().any()
    ragged = _ragged(path, table) if suspect else None
    if ragged is not None:
        raise ragged
    return frame


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _not_utf8(path: Path, table: str) -> DataValidationError:
    """Names the first line that is not UTF-8 and its first bad byte."""
    with _open(path) as raw:
        for number, line in enumerate(raw, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                byte = line[error.start]
                return _file_error(
                    table,
                    path,
                    f"line {number} is not UTF-8 (byte 0x{byte:02x}); re-save it as UTF-8",
                )
    return _file_error(table, path, "not UTF-8 text; re-save it as UTF-8")


def _records(path: Path) -> Iterator[tuple[int, int]]:
    """(first line number, field count) of every non-blank CSV record, the header first."""
    with _open(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as text:
        reader = csv.reader(text)
        line = 1
        for record in reader:
            if record:
                yield line, len(record)
            line = reader.line_num + 1


def _ragged(path: Path, table: str) -> DataValidationError | None:
    """The first record whose field count is not the header's, or None."""
    try:
        with closing(_records(path)) as records:
            _, header = next(records, (1, 0))
            for line, fields in records:
                if fields != header:
                    return _file_error(
                        table,
                        path,
                        f"line {line} has {fields} fields where the header has {header}; give "
                        "every line one field per header column (quote a value that holds a comma)",
                    )
    except csv.Error:
        return None  # pandas' own message says more
    return None
