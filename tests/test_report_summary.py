"""The report's first screen: the quality-per-bit verdict and plot from bench-quality records (any arm
names), speed beside mlx-lm's, and a check in a real browser (headless Chromium, when installed)."""

import json
import os
import shutil
import subprocess
import time

import pytest

from vqpipe.store import record
from vqpipe.bench import environment, summarize
from vqpipe.stages import report
from vqpipe.report.summary import frontier

from test_report import _artifacts, _write


def _quality_record(method, bits, bpw, kl, ppl):
    return {"bits": bits, "method": method, "bpw": {"bpw": bpw, "bpw_seed_rotation": bpw},
            "kl": summarize([kl * f for f in (0.8, 1.0, 1.3)]), "kl_mean": kl, "top1": summarize([0.9, 0.92, 0.95]),
            "ppl": summarize([ppl * f for f in (0.7, 1.0, 1.6)]), "ppl_mean": ppl, "tokens": 1536}


# (method, bits, bpw, KL, perplexity): vqpipe, its unrotated ablation, MLX affine and an arm whose name
# the report has never seen (another quantizer's); vqpipe's 2-bit is beaten by the new arm.
QUALITY = [("vqpipe", 2, 2.5, 0.99, 118.0), ("vqpipe", 3, 3.5, 0.25, 61.0), ("vqpipe", 4, 4.5, 0.07, 52.4),
           ("unrotated", 4, 4.5, 0.2, 60.0), ("affine-g64", 2, 2.5, 12.9, 900.0), ("affine-g64", 4, 4.5, 0.5, 72.0),
           ("affine-g32", 4, 5.0, 0.3, 66.0), ("new-quant", 2, 2.25, 0.8, 100.0), ("new-quant", 4, 4.25, 0.4, 70.0)]
SOURCE_PPL = 49.9


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("summary")
    env = environment()
    arts = _artifacts(env)
    arts["bench/real/quality.json"] = record.make("bench-quality", {
        "model": "real", "environment": env, "windows": 3, "length": 512,
        "source": {"method": "source", "source": "gguf:pkg:pkg/model.gguf", "ppl": summarize([40.0, 50.0, 70.0]),
                   "ppl_mean": SOURCE_PPL, "full_precision": True},
        "text": {"title": "T"},
        "generations": {"prompts": ["What is 2+2?"], "max_tokens": 8,
                        "arms": [{"arm": "source", "texts": ["4"]}, {"arm": "4-bit vqpipe", "texts": [""]}]},
        "records": [_quality_record(*q) for q in QUALITY]
        + [{"bits": 4, "method": "affine-g128", "group_size": 128, "skipped": "widths not multiples of 128"}]})
    _write(root / "in", arts)
    assert report.main(["--inputs", str(root / "in"), "--out", str(root / "out")]) == 0
    return root / "out"


def test_frontier():
    pts = [{"arm": a, "bits": b, "bpw": w, "kl": k} for a, b, w, k, _ in QUALITY if a != "unrotated"]
    front = [(p["arm"], p["bits"]) for p in frontier(pts)]
    assert front == [("new-quant", 2), ("vqpipe", 3), ("vqpipe", 4)]


def test_summary_leads_the_report(built):
    s = json.loads((built / "summary.json").read_text())
    q = s["quality"]["real"]
    assert q["source_ppl"] == SOURCE_PPL and len(q["points"]) == len(QUALITY)  # the skipped arm has no point
    assert [tuple(f) for f in q["frontier"]] == [("new-quant", 2), ("vqpipe", 3), ("vqpipe", 4)]
    md = (built / "report.md").read_text()
    assert md.startswith("# vqpipe report\n\n## Summary\n")
    first = md[:md.index("## Quality in detail")]
    assert "Verdict: vqpipe is on the quality-per-bit frontier at 3, 4 bits, not at 2" in first
    # Each vqpipe width against the lowest-KL other format no larger (never its own ablation).
    assert "| 4 | 4.500 | 0.07 | 52.4 (1.050× source) | new-quant (4-bit) | 4.250 | 0.4 | 70 | 5.71× lower |" in first
    assert "| 2 | 2.500 | 0.99 | 118 (2.365× source) | new-quant (2-bit) | 2.250 | 0.8 | 100 | 0.808× higher |" in first
    assert "![quality_bits](plots/quality_bits.png)" in first
    assert "| vqpipe-b4 |" in first and "| requantize-hadamard |" in first  # speed and load beside the others
    for term in ("KL is how far", "Bits per weight (bpw)", "an arm is", "The frontier", "A/A noise floor"):
        assert term in first, term
    assert md.index("## Summary") < md.index("## Quality in detail") < md.index("## Plumbing\n")
    assert md.index("## Plumbing\n") < md.index("## Plumbing: validate")
    for gone in ("seed rot.", "T_ref", "NOT met"):
        assert gone not in md, gone
    assert "(empty: this arm generated no visible text)" in md
    assert "perplexity (all tokens)" in md and "perplexity (windows)" in md


def test_quality_plot_without_bench_quality(tmp_path):
    from vqpipe.report.plots import plot_quality

    png = plot_quality({"quality": {}})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


# --- a real browser --------------------------------------------------------------------------------

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
WIDTH, HEIGHT = 1280, 800


class DevTools:
    """Chromium's DevTools protocol over --remote-debugging-pipe (fds 3 and 4, NUL-framed JSON)."""

    def __init__(self, user_data_dir):
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()

        def fds():
            os.dup2(cmd_r, 3)
            os.dup2(out_w, 4)

        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={user_data_dir}",
                                      f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self.buf, self.next_id = b"", 0

    def send(self, method, session=None, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.buf:
                chunk = os.read(self.out_r, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe (status {self.proc.poll()})")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, session, expression):
        r = self.send("Runtime.evaluate", session, expression=expression, returnByValue=True)
        return r["result"].get("value")

    def close(self):
        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.cmd_w)
        os.close(self.out_r)


FIRST_SCREEN = """(() => {
  const top = el => el ? el.getBoundingClientRect().top + window.scrollY : null;
  const heads = [...document.querySelectorAll('h2')];
  const byText = t => heads.find(h => h.textContent.startsWith(t));
  const verdict = [...document.querySelectorAll('p')].find(p => p.textContent.startsWith('Verdict:'));
  return {
    height: window.innerHeight,
    images: [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0, top: top(i)})),
    summary: top(byText('Summary')), verdict: top(verdict),
    plumbing: heads.filter(h => h.textContent.startsWith('Plumbing')).map(top),
  };
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (scripts/setup.sh installs Debian's chromium where apt-get is available)")
def test_report_in_a_browser(built, tmp_path):
    browser = DevTools(tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", url="about:blank")["targetId"]
        session = browser.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.send("Emulation.setDeviceMetricsOverride", session, width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                     mobile=False)
        browser.send("Page.navigate", session, url=(built / "index.html").as_uri())
        deadline = time.monotonic() + 60
        while browser.evaluate(session, "document.readyState") != "complete":
            assert time.monotonic() < deadline, "the report did not finish loading in 60 s"
            time.sleep(0.2)
        page = browser.evaluate(session, FIRST_SCREEN)
    finally:
        browser.close()
    assert len(page["images"]) == len(report.PLOTS)
    assert all(i["ok"] for i in page["images"]), [i["alt"] for i in page["images"] if not i["ok"]]
    h = page["height"]
    assert h == HEIGHT and page["summary"] < h and page["verdict"] < h  # the answer on the first screen
    quality = next(i for i in page["images"] if i["alt"] == "quality_bits")
    assert quality["top"] < h  # and the plot starts on it
    assert page["plumbing"] and min(page["plumbing"]) > 2 * h  # plumbing well below it
