"""Fuzz of the query endpoint's statement guard (fixed, small budget): any input is accepted or refused with a
SinkError, never anything else; dangerous forms are refused however they are spelled, disguised by case,
comments, quoting or whitespace; harmless statements that only mention dangerous names in strings pass."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus.core.errors import SinkError
from argus.sinks.query_server import REFUSED_FUNCTIONS, check_statement

BUDGET = settings(max_examples=300, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow])

DANGEROUS = sorted({"file", "url", "remote", "remoteSecure", "s3", "hdfs", "mysql", "postgresql", "jdbc", "odbc",
                    "executable", "input", "cluster", "python", "fileCluster", "s3Cluster", "azureBlobStorage"})
FIRST = ["SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS"]
WRITES = ["DROP DATABASE argus", "DROP TABLE argus.steps", "INSERT INTO argus.steps VALUES (1)", "TRUNCATE argus.steps",
          "ALTER TABLE argus.steps DELETE WHERE 1", "CREATE TABLE x (a Int8) ENGINE = Memory", "OPTIMIZE TABLE t",
          "SYSTEM SHUTDOWN", "KILL QUERY WHERE 1", "SET readonly = 0", "GRANT ALL ON *.* TO default",
          "INSERT INTO FUNCTION file('/tmp/x', 'CSV') SELECT 1", "RENAME TABLE a TO b", "DETACH TABLE t",
          "BACKUP TABLE t TO Disk('d', 'x')", "USE system", "(SELECT 1)", "CHECK TABLE t"]

SQL_CHARS = st.sampled_from([*"SELECTfromFILEurl()'\"`;-/*#$\\\n\r\t ,.0123456789_", "--", "/*", "*/", "\u00a0",
                             "\u200b", "\x00"])
SEPARATOR = st.sampled_from([" ", "", "\t", "\n", "/* c */", "/**/", "--c\n", "-- ';\n", "\u00a0", "\u3000",
                             "/* 'x */", "\r\n"])


def _case(draw: st.DrawFn, word: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(word, flips, strict=True))


@st.composite
def safe_prefix(draw: st.DrawFn) -> str:
    """A harmless start of a statement: an allowed keyword and balanced, innocuous pieces."""
    parts = [_case(draw, draw(st.sampled_from(FIRST)))]
    for _ in range(draw(st.integers(0, 4))):
        parts.append(draw(st.sampled_from([
            "1,", "count(),", "'file(''/etc/passwd'')',", "'it\\'s',", "\"col\",", "`t`.x,", "x AS url,",
            "/* file('x') */", "-- url('y')\n", "toString(file_size),", "[1, 2],", "(1 + 2) *",
        ])))
    return " ".join(parts)


@st.composite
def dangerous_call(draw: st.DrawFn) -> str:
    name = _case(draw, draw(st.sampled_from(DANGEROUS)))
    quote = draw(st.sampled_from(["", "`", '"']))
    return f"{quote}{name}{quote}{draw(SEPARATOR)}{draw(SEPARATOR)}('/etc/passwd')"


@BUDGET
@given(st.one_of(st.text(max_size=200), st.lists(SQL_CHARS, max_size=60).map("".join)))
def test_any_text_is_accepted_or_refused(sql: str) -> None:
    with contextlib.suppress(SinkError):  # anything else (IndexError, RecursionError, ...) fails the test
        check_statement(sql)


@BUDGET
@given(safe_prefix(), SEPARATOR, dangerous_call(), st.sampled_from(["", " LIMIT 1", ";", " -- x", " FORMAT CSV"]))
def test_table_and_file_functions_are_always_refused(prefix: str, sep: str, call: str, suffix: str) -> None:
    sql = f"{prefix}{sep} * FROM {call}{suffix}" if prefix.split()[0].upper() == "SELECT" else \
        f"{prefix} {sep}{call}{suffix}"
    with pytest.raises(SinkError):
        check_statement(sql)


@BUDGET
@given(SEPARATOR, st.sampled_from(WRITES), SEPARATOR)
def test_writes_and_other_statements_are_always_refused(lead: str, stmt: str, trail: str) -> None:
    with pytest.raises(SinkError):
        check_statement(f"{lead}{stmt}{trail}")


@BUDGET
@given(safe_prefix(), SEPARATOR, st.sampled_from([*WRITES, "SELECT 1"]))
def test_a_second_statement_is_always_refused(prefix: str, sep: str, second: str) -> None:
    with pytest.raises(SinkError):
        check_statement(f"{prefix} 1;{sep}{second}")


@BUDGET
@given(safe_prefix(), SEPARATOR, st.sampled_from(["OUTFILE", "outfile", "OutFile"]))
def test_into_outfile_is_always_refused(prefix: str, sep: str, outfile: str) -> None:
    with pytest.raises(SinkError):
        check_statement(f"{prefix} 1 INTO{sep} {outfile} '/tmp/x'")


@BUDGET
@given(safe_prefix(), st.text(alphabet=st.characters(blacklist_characters="'\\", blacklist_categories=("Cs",)),
                              max_size=40))
def test_dangerous_names_inside_strings_are_harmless(prefix: str, text: str) -> None:
    names = " ".join(f"{n}('x')" for n in sorted(REFUSED_FUNCTIONS)[:5])
    check_statement(f"{prefix} '{text} {names}' AS s")
