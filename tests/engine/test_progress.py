"""Progress of the model preparation: plain lines when stderr is not a terminal, a tqdm bar when it
is, the preparation's own lines, and the one estimate quoted alike in code and docs."""

from __future__ import annotations

import re
import time
from pathlib import Path


def test_plain_progress_lines_when_not_a_terminal():
    import io

    from gymserve.engine.progress import Progress

    stream = io.StringIO()
    with Progress("[1/2] copying", 1000, "B", stream=stream, interval_s=0.3) as bar:
        bar.update(50)
        time.sleep(0.8)  # nothing reported meanwhile: the heartbeat still prints
        for _ in range(19):
            bar.update(50)
            time.sleep(0.02)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "gymserve: [1/2] copying..."
    # Seconds are checked as digits: a busy machine stretches the sleeps.
    assert re.fullmatch(r"gymserve: \[1/2\] copying: 50 B/1\.0 kB \(5%\), \d+ s elapsed", lines[1])  # the heartbeat's
    assert re.fullmatch(r"gymserve: \[1/2\] copying: done in \d+ s", lines[-1])
    pcts = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines[1:-1]]
    assert pcts == sorted(pcts) and pcts[-1] >= 80 and len(set(pcts) - {5}) >= 4, lines  # the 10 % lines


def test_progress_bar_on_a_terminal():
    import io

    from gymserve.engine.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    with Progress("de-quantizing", 4, "tensors", stream=stream) as bar:
        for _ in range(4):
            time.sleep(0.15)  # past tqdm's minimum redraw interval (0.1 s)
            bar.update(1)
    text = stream.getvalue()  # tqdm draws ASCII bars on a stream with no UTF-8 encoding
    assert "\rde-quantizing:   0%|          | 0/4 [00:00<?, ?tensors/s]" in text
    assert "\rde-quantizing:  25%|##5       | 1/4 [00:0" in text
    assert re.search(r"\rgymserve: de-quantizing: done in \d+ s\n$", text)


def test_preparation_progress_lines(fake_wheels, model_cache, capfd):
    import gymserve.engine.model_store as ms

    ms.embedded_model_dir()
    err = capfd.readouterr().err
    assert (
        f"gymserve: preparing the embedded model Qwen2.5-Coder-0.5B-Instruct in "
        f"{model_cache / 'embedded' / 'Qwen2.5-Coder-0.5B-Instruct'}: one time, {ms.EMBEDDED_PREPARE_TIME}; later "
        "starts load it in seconds"
    ) in err
    assert "gymserve: [1/4] assembling the GGUF from 6 wheels..." in err
    assert "gymserve: [1/4] assembling the GGUF from 6 wheels: done in " in err
    assert "gymserve: [2/4] fake conversion: done in" in err
    ms.embedded_model_dir()
    assert capfd.readouterr().err == ""  # a finished entry is silent


def test_the_estimate_is_quoted_the_same_everywhere():
    from gymserve.engine.model_store import EMBEDDED_PREPARE_TIME

    root = Path(__file__).resolve().parents[2]
    for doc in ("docs/getting-started.md", "docs/model-servers/local.md"):  # the README links there
        text = " ".join((root / doc).read_text().split())  # prose wraps anywhere
        assert EMBEDDED_PREPARE_TIME in text, doc


def test_an_unsized_terminal_gets_plain_lines():
    """A pseudo-terminal nobody gave a size (0 columns) is a terminal tqdm draws nothing on."""
    import os
    import select

    from gymserve.engine.progress import Progress

    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        assert tty.isatty() and os.get_terminal_size(slave).columns == 0
        with Progress("[1/1] step", 2, "tensors", stream=tty) as bar:
            bar.update(2)
    text = ""
    while select.select([master], [], [], 0.5)[0]:  # a pty hands over what was written in pieces
        try:
            text += os.read(master, 4096).decode()
        except OSError:  # EIO: all read, and the other end is closed
            break
    os.close(master)
    assert re.fullmatch(
        r"gymserve: \[1/1\] step\.\.\.\ngymserve: \[1/1\] step: done in \d+ s\n", text.replace("\r\n", "\n")
    )
