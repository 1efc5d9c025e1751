#!/usr/bin/env python3
"""Render the bad-input / fault case table from a test run (issue #15).

    MIXGEMM_CASE_LOG=/tmp/cases.jsonl python -m pytest -q tests/
    python tools/case_table.py /tmp/cases.jsonl > cases.md

Each row is what a test asserted and recorded with the ``pin_case`` fixture (tests/conftest.py):
the tests are the source of truth, the table only summarises them.
"""
import json
import sys

GROUPS = ("Files", "Tensors", "Options", "Output path", "Interrupts", "Values", "API", "Kernel cache",
          "Command line")


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    seen, unique = set(), []
    for r in rows:
        key = (r["group"], r["case"], r["call"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    order = {g: i for i, g in enumerate(GROUPS)}
    unique.sort(key=lambda r: order.get(r["group"], len(GROUPS)))
    print("| group | case | command / API call | exit status or exception | first line of the message | left behind | test |")
    print("|---|---|---|---|---|---|---|")
    for r in unique:
        test = r["test"].split("[", 1)[0].split("::", 1)     # file::function, without parameters
        print(f"| {cell(r['group'])} | {cell(r['case'])} | `{cell(r['call'])}` | {cell(r['outcome'])} | "
              f"`{cell(r['first_line'])}` | {cell(r['leftovers'])} | {cell(test[0])}::{cell(test[1])} |")
    print(f"\n{len(unique)} cases, recorded from {len(rows)} assertions.")


if __name__ == "__main__":
    main(sys.argv[1])
