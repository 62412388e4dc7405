"""Reading local dataset files record by record, as `datasets` would read them: JSON Lines,
JSON (a list of records, or objects one after another), CSV with a header row, Parquet.

`read_rows` gives the first records for a preview and the type check; `records` walks the whole
file for data_scan.scan_file, handing a record that cannot be read over as a ValueError (with
its line or row) so the walk goes on. Every message names the file, the place and what to change.
Stdlib and pyarrow only: this runs in the web app's process.
"""

from __future__ import annotations

import codecs
import csv
import json
from pathlib import Path


def read_rows(path: Path, n: int = 5) -> list[dict]:
    """The first `n` records of a .jsonl/.json/.csv/.parquet file (ValueError saying what is wrong)."""
    rows = []
    for _, record in records(Path(path), batch_size=n):
        if isinstance(record, ValueError):
            raise record
        rows.append(record)
        if len(rows) == n:
            break
    if not rows:
        raise ValueError(f"{path} has no records")
    return rows


def check_folder(folder: Path) -> list[str]:
    """What stops `datasets` from reading a folder as one dataset, each naming the file: a file of
    a format the studio does not read (which `datasets` would read as something else, or skip), files
    of more than one format (`datasets` reads only the most common one and skips the rest
    silently), an unreadable file, or files whose columns differ (one table has one set of
    columns). Hidden files and documentation (.md) are left out, as `datasets` leaves them out."""
    files = sorted(f for f in Path(folder).rglob("*") if f.is_file() and not any(
        part.startswith((".", "__")) for part in f.relative_to(folder).parts) and f.suffix.lower() != ".md")
    kinds = {".jsonl": "JSON", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet"}
    others = [f for f in files if f.suffix.lower() not in kinds]
    if others:
        return [f"{f}: {f.suffix or 'a file without a suffix'} is not a format the studio reads in a dataset "
                f"folder; use .jsonl, .json, .csv or .parquet, or move it out of {folder}" for f in others[:5]]
    if not files:
        return [f"{folder} holds no .jsonl, .json, .csv or .parquet file; give a folder of such files, or a file"]
    by_kind: dict[str, list[Path]] = {}
    for f in files:
        by_kind.setdefault(kinds[f.suffix.lower()], []).append(f)
    if len(by_kind) > 1:
        listed = "; ".join(f"{kind}: {', '.join(f.name for f in group[:3])}{', ...' if len(group) > 3 else ''}"
                           for kind, group in by_kind.items())
        return [f"{folder} holds files of more than one format ({listed}); `datasets` would read only the most "
                "common format and skip the others without a word: keep files of one format in the folder"]
    problems, first = [], None
    for f in files:
        try:
            columns = list(dict.fromkeys(key for row in read_rows(f) for key in row))
        except ValueError as error:
            problems.append(str(error))
            continue
        if first is None:
            first = (f, columns)
        elif set(columns) != set(first[1]):
            problems.append(f"{f} has the columns {', '.join(columns)} and {first[0]} has {', '.join(first[1])}; "
                            "`datasets` reads the files of a folder as one table, so every file needs the same "
                            "columns: rename them, or move the odd file out")
    return problems


def records(path: Path, batch_size: int = 1024, columns: list[str] | None = None):
    """Each record of the file in order, as (where, record), `where` being e.g. "line 7" or "row 7".

    A record that cannot be read comes as (where, ValueError), and the next ones follow; a file
    that cannot be read on raises ValueError. `columns`: the only ones read from Parquet."""
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes): it holds no records; give a file that does")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_records(path, batch_size, columns)
    elif suffix in (".csv", ".jsonl", ".json"):
        try:
            yield from _csv_records(path) if suffix == ".csv" else _json_records(path)
        except UnicodeDecodeError as error:  # Python names only a position in its read buffer
            raise _not_utf8(path) from error
    else:
        raise ValueError(f"{path}: {suffix or 'this'} files are not read; use .jsonl, .json, .csv or .parquet")


def _not_utf8(path: Path) -> ValueError:
    """The first place in the file that is not UTF-8, and how to convert the file."""
    offset, convert = 0, f"{path.name} > {path.stem}-utf8{path.suffix}"
    with path.open("rb") as handle:
        if handle.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):  # Excel's "Unicode Text", Notepad's "Unicode"
            return ValueError(f"{path} is UTF-16 text; save it as UTF-8, e.g. `iconv -f utf-16 -t utf-8 {convert}`, "
                              "and give that file")
        handle.seek(0)
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                spreadsheet = ' (from a spreadsheet: save as "CSV UTF-8")' if path.suffix.lower() == ".csv" else ""
                return ValueError(
                    f"{path}: line {number} is not UTF-8 text (byte 0x{line[error.start]:02x} at offset "
                    f"{offset + error.start:,} in the file); save the file as UTF-8, e.g. if it is Latin-1: "
                    f"`iconv -f latin1 -t utf-8 {convert}`{spreadsheet}, and give that file")
            offset += len(line)
    return ValueError(f"{path} is not UTF-8 text; save it as UTF-8, e.g. with `iconv -f latin1 -t utf-8`")


def _parquet_records(path: Path, batch_size: int, columns: list[str] | None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=columns):
            for record in batch.to_pylist():
                number += 1
                yield f"row {number}", record
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{path} is not a readable Parquet file ({error})") from error


def _csv_records(path: Path):
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        if not any(name.strip() for name in header):
            raise ValueError(f"{path}: line 1 names no columns; a CSV file needs a header row naming them, "
                             "e.g. prompt,completion")
        odd = [name for name in header if _not_a_name(name) or header.count(name) > 1]
        if odd:
            raise ValueError(f"{path}: line 1 does not look like a header row ({odd[0]!r} is not a column "
                             "name); a CSV file needs a first line naming the columns, e.g. prompt,completion")
        try:
            for values in reader:
                where = f"line {reader.line_num}"
                if len(values) > len(header):
                    yield where, ValueError(f"{path}: {where} has {len(values)} fields but the header "
                                            f"names {len(header)} columns")
                elif values:  # an empty field is a missing value, as `datasets` (pandas) reads CSV
                    yield where, {name: value or None for name, value in zip(header, values + [""] * len(header))}
        except csv.Error as error:
            raise ValueError(f"{path}: line {reader.line_num} is not valid CSV ({error})") from error


def _not_a_name(name: str) -> bool:
    """True for a header cell that reads like data: empty, a number, or a sentence."""
    text = name.strip()
    return (not text or text.replace(".", "", 1).lstrip("-").isdigit()
            or text.endswith((".", "?", "!")) or len(text.split()) > 4)


def _json_records(path: Path):
    # As `datasets` reads .json and .jsonl alike: a file starting with "[" is one list of
    # records (of strings: a `text` column), anything else is JSON objects one after another.
    with path.open(encoding="utf-8-sig") as handle:
        seen = False
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if not seen and line.lstrip().startswith("["):
                handle.seek(0)
                _, data = next(_objects(handle.read(), path))
                as_text = bool(data) and isinstance(data[0], str)
                for i, record in enumerate(data):
                    where = f"record {i + 1} of the list"
                    yield where, _record({"text": record} if as_text else record, path, where)
                return
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if seen:
                    yield f"line {number}", _bad_json(path, number, error)
                    continue
                handle.seek(0)  # not one object per line: maybe pretty-printed objects
                for start, value in _objects(handle.read(), path):
                    yield f"line {start}", _record(value, path, f"line {start}")
                return
            seen = True
            yield f"line {number}", _record(record, path, f"line {number}")
    if not seen:
        raise ValueError(f"{path} is empty (blank lines only): it holds no records; give a file that does")


def _objects(text: str, path: Path):
    """The JSON values in text, one after another, each with the line it starts on."""
    decoder, pos, line, counted = json.JSONDecoder(), 0, 1, 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            raise _bad_json(path, error.lineno, error) from error
        line, counted = line + text.count("\n", counted, pos), pos
        yield line, value
        pos = end


def _bad_json(path: Path, line: int, error: json.JSONDecodeError) -> ValueError:
    return ValueError(f"{path}: line {line} is not valid JSON ({error.msg} at column {error.colno})")


def _record(record, path: Path, where: str) -> dict | ValueError:
    if not isinstance(record, dict):
        kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
            type(record), "null")
        return ValueError(f"{path}: {where} is a JSON {kind}, not an object; each record must be an object "
                          'naming its columns, e.g. {"prompt": "...", "completion": "..."}')
    return record
