"""The README's section "Using it with Lightning, Accelerate and torchrun" runs as written:
every ```python block is saved under the file name its first line gives and launched with
the command that line gives (`python NAME` or `torchrun --nproc_per_node=N NAME`), in an empty
directory; every rank must print its loader's `stats()` with batches that came through slots."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from ._launch import REPO, run_python

DOC = os.path.join(REPO, "README.md")
SECTION = "## Using it with Lightning, Accelerate and torchrun"
HEADER = re.compile(r"# (?P<name>\w+\.py) -- run: (?P<command>.+)")


def snippets() -> list[tuple[str, str, list[str]]]:
    """(file name, code, command words) of each python block of the document."""
    with open(DOC) as doc:
        text = doc.read()
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    found = []
    for code in blocks:
        header = HEADER.fullmatch(code.splitlines()[0])
        assert header, f"a python block of {DOC} does not start with '# NAME.py -- run: COMMAND'"
        found.append((header["name"], code, shlex.split(header["command"])))
    return found


def test_the_document_has_the_three_snippets():
    assert [name for name, _, _ in snippets()] == ["train_lightning.py", "train_accelerate.py",
                                                  "train_ddp.py"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, code, command", snippets(), ids=[s[0] for s in snippets()])
def test_snippet_runs(name, code, command, tmp_path):
    for package in ("lightning", "accelerate"):
        if re.search(rf"^(import|from) {package}\b", code, flags=re.M):
            pytest.importorskip(package)
    (tmp_path / name).write_text(code)
    if command[0] == "python":
        assert command[1:] == [name]
        ranks = 2 if 'devices=2' in code else 1  # Lightning's DDP starts the other rank itself
        done = run_python(name, cwd=str(tmp_path))
    else:
        assert command[0] == "torchrun" and command[2:] == [name], command
        ranks = int(command[1].removeprefix("--nproc_per_node="))
        done = run_python(name, torchrun_ranks=ranks, cwd=str(tmp_path))
    # print(stats), at a line's start, or right after a progress bar's "]": the other rank's
    # bar may not have ended its line when this rank writes (a CI run: "v_num=0]1 shmloader: ...")
    printed = {int(m[1]): int(m[2]) for m in
               re.finditer(r"(?:^|(?<=\]))(\d+) shmloader: (\d+) batches;", done.stdout, flags=re.M)}
    assert sorted(printed) == list(range(ranks)), done.stdout[-3000:]
    assert all(batches > 0 for batches in printed.values()), printed
