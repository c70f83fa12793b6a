"""The DuckDB connection the ``duckdb`` engine runs in (the ``scale`` extra): its memory limit,
the directory it spills to past it, and its errors as kvlens's."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlens import sqltext
from kvlens.errors import InputError, MissingExtra
from kvlens.limits import DEFAULT_MEMORY_LIMIT, parse_size


def duckdb_module() -> Any:
    """The ``duckdb`` module, or :class:`MissingExtra` (the scale extra)."""
    try:
        import duckdb
    except ModuleNotFoundError as error:
        raise MissingExtra("the duckdb engine", "scale") from error
    return duckdb


@dataclass
class Engine:
    """A DuckDB connection with a memory limit it honours by spilling to ``temp_directory``."""

    memory_limit: str = DEFAULT_MEMORY_LIMIT
    temp_directory: str | None = None  # default: a new directory, removed on close
    threads: int | None = None
    connection: Any = field(init=False)
    _spill: tempfile.TemporaryDirectory[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        duckdb = duckdb_module()
        refused = f"memory limit {self.memory_limit!r} is not a size DuckDB takes"
        try:
            # in bytes, as the one size parser reads it: the settings take what DuckDB is handed
            limit = f"{round(parse_size(self.memory_limit))}B"
        except ValueError as error:
            raise InputError(refused) from error
        if self.temp_directory is None:
            try:
                self._spill = tempfile.TemporaryDirectory(prefix="kvlens-duckdb-")
            except OSError as error:  # CPython names no file when no candidate is writable
                raise InputError(
                    f"no temporary directory for DuckDB to spill to ({error.strerror or error}): "
                    "set TMPDIR to a writable directory"
                ) from error
        self.connection = duckdb.connect(":memory:")
        spill = self.temp_directory or self._spill.name  # type: ignore[union-attr]
        try:
            self.connection.execute(f"SET memory_limit = {sqltext.duckdb_text(limit)}")
        except duckdb.Error as error:
            self.close()  # the spill directory with it
            raise InputError(refused) from error
        self.connection.execute(f"SET temp_directory = {sqltext.duckdb_text(spill)}")
        self.connection.execute("SET preserve_insertion_order = false")
        self.connection.execute("SET enable_progress_bar = false")
        # every pass reads the Parquet footers again (the order statistics a chunk at a time)
        self.connection.execute("SET parquet_metadata_cache = true")
        if self.threads:
            self.connection.execute(f"SET threads = {int(self.threads)}")

    @property
    def spill_directory(self) -> str:
        """Where DuckDB writes what passes the memory limit."""
        return self.temp_directory or self._spill.name  # type: ignore[union-attr]

    def spilled(self) -> int:
        """Bytes DuckDB holds in temporary files now (past the memory limit)."""
        rows = self.connection.execute(
            "SELECT COALESCE(SUM(size), 0) FROM duckdb_temporary_files()"
        ).fetchall()
        return int(rows[0][0])

    def memory_limit_bytes(self) -> float:
        """The memory limit as DuckDB holds it (``'1.8 GiB'``), in bytes."""
        ((limit,),) = self.connection.execute("SELECT current_setting('memory_limit')").fetchall()
        return parse_size(str(limit))

    @contextlib.contextmanager
    def registered(self, tables: dict[str, dict[str, Any]]) -> Iterator[None]:
        """``tables`` (name: numpy columns) readable by name in SQL while in the block."""
        for name, table in tables.items():
            self.connection.register(name, table)
        try:
            yield
        finally:
            for name in tables:
                self.connection.unregister(name)

    def close(self) -> None:
        self.connection.close()
        if self._spill is not None:
            self._spill.cleanup()


@contextlib.contextmanager
def engine_errors(memory_limit: str, spill: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """DuckDB's errors as :class:`InputError` (a clear message and exit 2, never a trace):
    running out of memory names the limit to raise, or the temporary directory ``spill`` when
    that is what ran out (DuckDB caps its temporary files at the free space of their disk);
    the rest (a corrupt file, an unreadable URL) carry DuckDB's own first line, which names
    the file."""
    duckdb = duckdb_module()
    try:
        yield
    except duckdb.OutOfMemoryException as error:
        if "max_temp_directory_size" in str(error):
            raise InputError(
                f"DuckDB's temporary directory {spill or 'TMPDIR'} is full (it spills there past the "
                f"memory limit {memory_limit}): free space there, set TMPDIR to a larger disk, or "
                "raise --memory-limit"
            ) from error
        raise InputError(
            f"DuckDB needed more than the memory limit {memory_limit} (it spills what it can to "
            "disk, but some steps need a minimum): raise --memory-limit or analyze_memory_limit"
        ) from error
    except duckdb.Error as error:
        raise InputError(f"DuckDB: {str(error).splitlines()[0]}") from error
