"""vqpipe.text: the real English evaluation / calibration text (Debian dict-devil)."""

import numpy as np
import pytest

from vqpipe import text


@pytest.fixture(scope="module")
def tok(tiny_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_source))


def test_splits_are_disjoint_and_cover_the_book():
    heads = [h for h, _ in text.entries()]
    assert len(heads) > 900
    assert heads[0] == "abasement" and heads[-1] == "zoology"  # book order
    ev, cal = text.text("eval"), text.text("calibration")
    ev_entries = {t for h, t in text.entries() if text.split_of(h) == "eval"}
    cal_entries = {t for h, t in text.entries() if text.split_of(h) == "calibration"}
    assert not ev_entries & cal_entries
    assert 0.1 < len(ev) / (len(ev) + len(cal)) < 0.3
    assert "ABSENTEE, n. A person with an income" in ev and "ABSENTEE" not in cal
    with pytest.raises(ValueError, match="'test'"):
        text.text("test")


def test_windows_and_calibration(tok):
    windows = text.eval_windows(tok, 20, 128)
    assert len(windows) == 20 and all(w.shape == (128,) for w in windows)
    eval_ids = text.tokens(tok, "eval")
    assert windows[0].tolist() == eval_ids[:128]
    with pytest.raises(ValueError, match="too few"):
        text.eval_windows(tok, 20, len(eval_ids))
    a = np.array(text.calibration_tokens(tok, 16, 64, seed=1))
    assert a.shape == (16, 64) and a.dtype == np.int32
    assert np.array_equal(a, np.array(text.calibration_tokens(tok, 16, 64, seed=1)))
    assert not np.array_equal(a, np.array(text.calibration_tokens(tok, 16, 64, seed=2)))
    assert len({tuple(r) for r in a.tolist()}) == 16
    # Calibration windows never come from the eval text.
    cal = text.tokens(tok, "calibration")
    row = a[3].tolist()
    assert any(cal[i:i + 64] == row for i in range(0, len(cal) - 63, 64))


def test_provenance():
    p = text.provenance()
    assert p["package"] == "Debian dict-devil" and p["package_version"]
    assert "public domain" in p["license"] and len(p["file_sha256"]) == 64
    assert p["entries"]["eval"] + p["entries"]["calibration"] == len(text.entries())


def test_jargon_provenance_and_windows(tok):
    p = text.provenance("jargon")
    assert p["package"] == "Debian dict-jargon" and p["package_version"].startswith("4.4.7")
    assert p["corpus"] == "jargon" and "public domain" in p["license"] and len(p["file_sha256"]) == 64
    assert p["entries"] == {"eval": len(text.entries("jargon"))} and p["entries"]["eval"] > 2000
    heads = [h for h, _ in text.entries("jargon")]
    assert not any(h.startswith("00") for h in heads)  # the database header entries are dropped
    # body paragraphs are dedented and reflowed into single lines
    bar = dict(text.entries("jargon"))["bar"]
    assert "[very common] The second {metasyntactic variable}, after {foo} and before {baz}." in bar
    assert "\n    " not in bar  # (quoted verse and code stay indented, line by line, as in the Devil's)
    # a different text from the Devil's, and no calibration split to mix it into the quantizer
    assert text.provenance()["corpus"] == "devil" and text.provenance()["file_sha256"] != p["file_sha256"]
    with pytest.raises(ValueError, match="no calibration split"):
        text.text("calibration", "jargon")
    with pytest.raises(ValueError, match="unknown text 'bible'"):
        text.provenance("bible")
    w = text.eval_windows(tok, 4, 64, corpus="jargon")
    assert len(w) == 4 and w[0].tolist() == text.tokens(tok, "eval", "jargon")[:64]
