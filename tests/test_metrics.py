"""train/metrics.py: what the trainer shows and logs while it runs."""
import io
import sys

from oomb.train.metrics import chunk_progress


def test_chunk_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err, sys.stderr = sys.stderr, Terminal()
    try:
        with chunk_progress("step 1") as progress:
            for done in range(1, 8):
                progress(done, 7)
        drawn = sys.stderr.getvalue()
    finally:
        sys.stderr = err
    assert "step 1:" in drawn and "/7 [" in drawn  # the bar shows the step's 7 chunk passes
