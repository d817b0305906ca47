"""Bad input to every command ends with one clear line on stderr and a non-zero exit, never a
traceback (the runner in ``pagemem/cli.py``; ``pagemem train``'s own cases are in
``test_cmd_train.py``, doctor's and io-tune's in theirs)."""

from __future__ import annotations

import pytest

from tests.conftest import exit_status

CASES = [
    (["plan", "--gpu_bytes", "-1"], "gpu_bytes"),
    (["plan", "--trace", "/does/not/exist.json"], "/does/not/exist.json"),
    (["plan", "--gpu"], "unrecognized arguments: --gpu"),
    (["simulate", "--profile", "nope"], "nope"),
    (["simulate", "--model", "tiny", "--gpu_bytes", "1KiB"], "smallest GPU budget"),
    (["trace", "--seq", "-5"], "seq"),
    (["trace", "--model", "tiny", "--synthetic", "--out_dir", "/proc/no/such"], "cannot use /proc/no"),
    (["demo", "--nvme_path", "/does/not/exist"], "nvme_path"),
    (["demo", "--page_bytes", "1000"], "page_bytes"),
    (["profile", "--nvme_path", "/does/not/exist", "--out", "/tmp/never.json"], "nvme_path"),
    (["profile", "--show", "nope"], "nope"),
    (["io-tune", "/does/not/exist"], "nvme_path"),
    (["doctor", "--nvme_path", "/proc"], "nvme_path"),
    (["bench", "--only", "nope"], "nope"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["nope"], "invalid choice"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_on_stderr_and_a_non_zero_exit(argv, needle, capsys):
    rc = exit_status(*argv)
    out, err = capsys.readouterr()
    err = err.strip()
    assert rc not in (0, None)
    assert needle in err and "\n" not in err, err
    assert "Traceback" not in err + out
