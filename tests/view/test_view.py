"""`kvrescue view`: the page's data against the traces and `kvrescue report`, bad input, and the page itself in
a real headless chromium (driven through chromium-driver by selenium): tables, problem list, problem page,
no network request, untrusted text shown as text."""

import base64
import gzip
import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.outputs import Candidate, ModelRef, RunConfig, RunFolder, Step, Tokens, Trace, read_traces, run_dir
from kvrescue.view.browser import chromium_paths, headless_chromium, open_view

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "helper": ModelRef("Qwen/Qwen2.5-Math-1.5B-Instruct"),
          "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
ROLES = {"full": ("base", "prm"), "bon": ("base", "prm"), "kvrescue": ("base", "helper", "prm")}
DUCKS = ("Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
         "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
         "egg. How much in dollars does she make every day at the farmers' market?")
ROBE = "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?"
# Markup outside maths and inside it, commands KaTeX must not obey untrusted, LaTeX that does not parse, and dollars.
HOSTILE_MATHS = [("math", "$\\frac{1}{2}+\\frac{1}{4}$"), ("math", "$\\href{javascript:window.pwned=2}{x}$"),
                 ("math", "$\\htmlId{x}{y}$"), ("math", '\\(<img src=x onerror="window.pwned=3">\\)'),
                 ("math", "\\[a</script><script>window.pwned=4</script>\\]"), ("math-error", "$\\frac{$")]
HOSTILE = (f'Simplify {HOSTILE_MATHS[0][1]}. </script><img src=x onerror="window.pwned=1"><b>bold</b> '
           + " ".join(tex for _, tex in HOSTILE_MATHS[1:]) + " It costs $5 and $10.")
USES = "She eats 3 eggs and bakes with 4, so she uses $3 + 4 = 7$ eggs a day.\n\n"
PROMPT = 150
LOOP = "The remainder is 16 - 7 = 7 eggs. " * 12 + "\n\n"

# Per method and problem: (correct, pred, steps), each step (source, text, score, a base candidate the detector stopped).
TRAJECTORIES = {
    "full": {0: (True, "18", [("base", USES, 0.93, None), ("base", "She sells 16 - 7 = 9 eggs for $2 each.\n\n", 0.90, None),
                              ("base", "She makes 9 \\times 2 = 18 dollars: \\boxed{18}", 0.95, None)]),
             1: (True, "3", [("base", "White fiber: 2 / 2 = 1 bolt, so 2 + 1 = \\boxed{3} bolts.", 0.97, None)])},
    "bon": {0: (False, "14", [("base", USES, 0.91, None), ("base", LOOP, 0.41, None),
                              ("base", "So she makes 7 \\times 2 = \\boxed{14} dollars.", 0.22, None)]),
            1: (True, "3", [("base", "2 + 1 = \\boxed{3}", 0.88, None)])},
    "kvrescue": {0: (True, "18", [("base", USES, 0.91, None),
                                  ("helper", "The remainder is 16 - 7 = 9 eggs, which she sells.\n\n", 0.88, "repetition"),
                                  ("base", "She sells 9 eggs at $2 each: 9 \\times 2 = 18.\n\n", 0.90, "entropy"),
                                  ("helper", "She makes \\boxed{18} dollars every day.", 0.94, None)]),
                 1: (True, "3", [("base", "2 + 1 = \\boxed{3}", 0.86, None)])},
}


def candidates(method: str, source: str, score: float, stopped: str | None, tokens: int) -> list[Candidate]:
    """N = 2 per model: the committed one first among its source's, then the others (one stopped by the detector
    when `stopped` names its test)."""
    detector = method == "kvrescue"
    out = []
    for src, count in (("base", 2), ("helper", 2 if method == "kvrescue" else 0)):
        for k in range(count):
            committed = src == source and k == 0
            fired = src == "base" and not committed and stopped is not None and k == 1
            out.append(Candidate(
                src, None if fired else (score if committed else round(score - 0.2 - 0.1 * k, 3)),
                tokens if not fired else 180, stopped if fired else "step",
                (7.6 if stopped == "entropy" and fired else 2.1) if detector and src == "base" else None,
                (0.15 if stopped == "repetition" and fired else 0.42) if detector and src == "base" else None,
                180 if fired else None, committed,
                None if committed else ("So so so so so " * 40 if fired else f"another {src} step {k}\n\n")))
    return out


def make_trace(method: str, idx: int, problem: str, gt: str, correct: bool, pred: str, steps: list) -> Trace:
    """The base cache starts at PROMPT rows and grows by each step; evicted (B = 64) back to B once it reaches B'."""
    recorded, cands, held, peak = [], [], PROMPT, PROMPT
    for source, text, score, stopped in steps:
        tokens = len(text.split()) + 2
        held += tokens
        peak = max(peak, held)
        held = 64 if method != "full" and held >= 64 + 128 else held
        recorded.append(Step(text, source, score, tokens, base_rows=held))
        cands.append(candidates(method, source, score, stopped, tokens))
    per_model = {src: sum(c.tokens for cs in cands for c in cs if c.source == src) for src in ("base", "helper")}
    return Trace(idx, problem, gt, gt, recorded, cands, "".join(s.text for s in recorded), pred, correct, False, "eos",
                 None, Tokens(base=per_model["base"], base_prefill=PROMPT, helper=per_model["helper"], prm=200),
                 len(recorded), {"wall_s": 1.5, "started_at": 1000.0 + idx, "finished_at": 1001.5 + idx}, peak, 0)


def write_run(root: Path, method: str, bench: str, traces: list[Trace], finished: bool = True) -> Path:
    budget = None if method == "full" else 64
    cfg = RunConfig(bench, method, budget, 2, "rkv" if budget else "none", 0, {r: MODELS[r] for r in ROLES[method]},
                    "prm", False, {"temperature": 0.8})
    path = run_dir(root, cfg)
    with RunFolder.open(path, cfg, total=len(traces) + (0 if finished else 1)) as folder:
        for trace in traces:
            folder.append(trace)
        if finished:
            folder.write_summary()
    return path


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """gsm8k: full, bon and kvrescue on two problems (bon loops on the first); math500: a bon run in progress
    on a problem whose text tries to inject markup, its candidates without texts (an older trace); a folder with
    a config but no traces."""
    root = tmp_path_factory.mktemp("runs")
    for method, problems in TRAJECTORIES.items():
        write_run(root, method, "gsm8k", [make_trace(method, idx, (DUCKS, ROBE)[idx], ("18", "3")[idx], *spec)
                                          for idx, spec in problems.items()])
    older = make_trace("bon", 123, HOSTILE, "\\frac{3}{4}", False, "1", [("base", "It is $1$.", 0.3, None)])
    for cands in older.candidates:  # as written before candidates' texts were recorded
        for c in cands:
            c.text = None
    write_run(root, "bon", "math500", [older], finished=False)
    empty = RunConfig("math500", "full", None, 2, "none", 0, {"base": MODELS["base"]}, "prm")
    RunFolder.open(run_dir(root, empty), empty, total=3).close()
    return root


@pytest.fixture(scope="module")
def page(runs_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("view") / "runs.html"
    result = CliRunner().invoke(app, ["view", str(runs_root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "no finished problems yet" in result.output and "in progress" in result.output
    return out


def unpack(html: str, element_id: str) -> object:
    packed = re.search(f'<script type="application/octet-stream" id="{element_id}">([^<]*)</script>', html).group(1)
    return orjson.loads(gzip.decompress(base64.b64decode(packed)))


def cli_stdout(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_page_holds_the_report_json_and_every_trace(page, runs_root):
    html = page.read_text(encoding="utf-8")
    data = unpack(html, "kv-data")
    assert data["report"] == orjson.loads(cli_stdout("report", str(runs_root), "--format", "json"))
    assert len(data["runs"]) == 4 and len(data["rows"]) == 4
    for run, rows in zip(data["runs"], data["rows"]):
        recorded = sorted(read_traces(Path(run["folder"]) / "traces.jsonl"), key=lambda t: t.idx)
        chunks = sorted(int(c) for c in re.findall(f'id="kv-run-{run["id"]}-([0-9]+)"', html))
        assert chunks == sorted({t.idx // data["chunk"] for t in recorded})
        details = [trace for c in chunks for trace in unpack(html, f'kv-run-{run["id"]}-{c}')]
        assert len(details) == len(rows) == len(recorded)
        for row, mine, trace in zip(rows, details, recorded):
            expected = asdict(trace)
            assert mine == {k: v for k, v in expected.items() if k not in ("problem", "gt", "gt_norm", "output")}
            assert row == {"idx": trace.idx, "correct": trace.correct, "stop": trace.stop,
                           "skip_reason": trace.skip_reason, "n_steps": trace.n_steps,
                           "tokens": {"base": trace.tokens.base, "helper": trace.tokens.helper}}
            assert [(p["problem"], p["gt"], p["gt_norm"]) for p in data["problems"]
                    if p["idx"] == trace.idx and p["bench"] == run["bench"]] == [(trace.problem, trace.gt, trace.gt_norm)]
    in_progress = [r for r in data["runs"] if r["in_progress"]]
    assert [(r["bench"], r["method"]) for r in in_progress] == [("math500", "bon")] and in_progress[0]["label"].endswith("*")
    assert data["plot"].startswith("<svg") and data["plot_note"] is None


def test_candidate_texts_can_be_left_out(runs_root, tmp_path):
    out = tmp_path / "small.html"
    result = CliRunner().invoke(app, ["view", str(runs_root), "--out", str(out), "--no-candidate-texts"])
    assert result.exit_code == 0, result.output
    html = out.read_text(encoding="utf-8")
    assert unpack(html, "kv-data")["candidate_texts"] is False
    for element_id in re.findall(r'id="(kv-run-[0-9]+-[0-9]+)"', html):
        for trace in unpack(html, element_id):
            assert all(c["text"] is None for cands in trace["candidates"] for c in cands)
            assert trace["steps"]  # the committed texts stay


def test_untrusted_text_cannot_leave_the_data_element(page):
    html = page.read_text(encoding="utf-8")  # the scripts: KaTeX's, the page's, the index and the detail chunks
    assert html.count("</script>") == 3 + len(re.findall('id="kv-run-', html)) and "onerror" not in html
    assert 'http-equiv="Content-Security-Policy" content="default-src \'none\';' in html


def test_no_usable_run_is_a_one_line_error_and_writes_nothing(tmp_path):
    out = tmp_path / "runs.html"
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["view", str(tmp_path / "empty"), "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.startswith("error: no usable run folders") and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_an_out_folder_is_a_one_line_error(runs_root, tmp_path):
    result = CliRunner().invoke(app, ["view", str(runs_root), "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith(f"error: --out {tmp_path} is a folder")


# ---------------------------------------------------------------------------------------------
# In a real browser
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if chromium_paths() is None:
        pytest.skip("chromium and chromium-driver are not installed (scripts/browser.sh installs them)")
    driver = headless_chromium(tmp_path_factory.mktemp("chromium"))
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def no_script_errors(request):
    """Every browser test ends with an empty console: no script error, no blocked request."""
    yield
    if "browser" in request.fixturenames:
        assert request.getfixturevalue("browser").get_log("browser") == []


def texts(elements) -> list[str]:
    return [e.get_attribute("textContent") for e in elements]


# The text an element shows, each piece of maths KaTeX drew taken as its source (data-tex).
SOURCES = """const source = node => node.nodeType !== Node.ELEMENT_NODE ? node.textContent
    : node.dataset.tex !== undefined ? node.dataset.tex : [...node.childNodes].map(source).join("");
return [...document.querySelectorAll(arguments[0])].map(source);"""


def sources(browser, selector: str) -> list[str]:
    return browser.execute_script(SOURCES, selector)


def test_report_tables_equal_the_report_and_nothing_is_fetched(browser, page, runs_root):
    from selenium.webdriver.common.by import By

    browser.get_log("performance"), browser.get_log("browser")  # drop what came before
    open_view(browser, page)
    events = [json.loads(entry["message"])["message"] for entry in browser.get_log("performance")]
    requests = [e["params"] for e in events if e["method"] == "Network.requestWillBeSent"]
    assert {r["request"]["url"] for r in requests if r["documentURL"].startswith(page.as_uri())} == {page.as_uri()}
    assert browser.get_log("browser") == []  # no request blocked by the page's Content-Security-Policy either
    assert browser.execute_script("return window.KV.data.report") == \
        orjson.loads(cli_stdout("report", str(runs_root), "--format", "json"))
    # Every rendered table equals `kvrescue report --format md`, cell by cell.
    markdown = cli_stdout("report", str(runs_root), "--format", "md")
    expected = []
    for block in markdown.split("### ")[1:]:
        lines = [line for line in block.splitlines() if line.startswith("| ")]
        expected.append([[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines])
    shown = []
    for section in browser.find_elements(By.CSS_SELECTOR, "#report-tables section"):
        shown.append([texts(section.find_elements(By.CSS_SELECTOR, "thead th"))] +
                     [texts(row.find_elements(By.TAG_NAME, "td")) for row in section.find_elements(By.CSS_SELECTOR, "tbody tr")])
    assert shown == expected
    assert browser.find_elements(By.CSS_SELECTOR, ".plot svg")


def test_problem_list_filters_and_search(browser, page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_view(browser, page, "#problems")
    rows = lambda: [(r.get_attribute("data-bench"), int(r.get_attribute("data-idx")))  # noqa: E731
                    for r in browser.find_elements(By.CSS_SELECTOR, "#problem-list tbody tr")]
    assert rows() == [("gsm8k", 0), ("gsm8k", 1), ("math500", 123)]
    Select(browser.find_element(By.NAME, "verdict")).select_by_value("disagree")
    assert rows() == [("gsm8k", 0)]
    Select(browser.find_element(By.NAME, "verdict")).select_by_value("any")
    Select(browser.find_element(By.NAME, "method")).select_by_value("kvrescue")
    assert rows() == [("gsm8k", 0), ("gsm8k", 1)]
    assert texts(browser.find_elements(By.CSS_SELECTOR, "#problem-list thead th"))[4:] == ["kvrescue B=64 N=2 s0"]
    Select(browser.find_element(By.NAME, "method")).select_by_value("")
    browser.find_element(By.NAME, "search").send_keys("robe")
    assert rows() == [("gsm8k", 1)]
    # The hostile problem text is shown as text, and nothing in it ran.
    browser.find_element(By.NAME, "search").clear()
    browser.find_element(By.NAME, "search").send_keys("simplify")
    assert sources(browser, "#problem-list td.problem-text") == [HOSTILE]
    open_view(browser, page, "#p/math500/123")  # its trace is in the run's seventh detail chunk
    assert sources(browser, "#problem-text") == [HOSTILE]
    assert sources(browser, "#side-by-side .step-text") == ["It is $1$."]
    browser.find_element(By.CSS_SELECTOR, "#side-by-side button.link").click()
    assert "written before candidates' texts were recorded" in browser.find_element(By.CSS_SELECTOR, "table.candidates caption").text
    assert browser.execute_script("return window.pwned") is None


def test_problem_page_shows_each_runs_steps_side_by_side(browser, page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_view(browser, page, "#problems")
    browser.find_element(By.CSS_SELECTOR, '#problem-list tr[data-bench="gsm8k"][data-idx="0"]').click()
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.drawn") == "p/gsm8k/0")
    assert browser.find_element(By.ID, "problem-text").get_attribute("textContent") == DUCKS
    headers = browser.find_elements(By.CSS_SELECTOR, "#side-by-side th.run")
    methods = ["full", "bon", "kvrescue"]
    assert [h.get_attribute("textContent").split(" ")[0] for h in headers] == methods
    for method, header in zip(methods, headers):  # the base cache length per step, as drawn
        held = [step.base_rows for step in make_trace(method, 0, DUCKS, "18", *TRAJECTORIES[method][0]).steps]
        points = header.find_element(By.CSS_SELECTOR, "svg.chart polyline").get_attribute("points").split()
        assert len(points) == len(held)
        assert f"max {max(held)}" in header.find_element(By.CSS_SELECTOR, "svg.chart text").get_attribute("textContent")
    rows = browser.find_elements(By.CSS_SELECTOR, "#side-by-side tbody tr")
    assert len(rows) == max(len(TRAJECTORIES[m][0][2]) for m in methods)
    for i, row in enumerate(rows):
        cells = row.find_elements(By.CSS_SELECTOR, "td.step")
        for method, cell in zip(methods, cells):
            steps = TRAJECTORIES[method][0][2]
            if i >= len(steps):
                assert cell.get_attribute("textContent") == ""
                continue
            source, text, score, stopped = steps[i]
            assert cell.get_attribute("data-source") == source
            assert sources(browser, f'#side-by-side tr[data-step="{i}"] td.step:nth-child({methods.index(method) + 2}) '
                                    ".step-text") == [text]
            assert cell.find_element(By.CSS_SELECTOR, ".score").text == f"score {score:.3f}"
            assert ("detector stopped 1" in cell.text) == (stopped is not None)
    # The kvrescue column's second step: the helper rescued it; its 4 candidates, the base one stopped by the detector.
    rescued = rows[1].find_elements(By.CSS_SELECTOR, "td.step")[2]
    rescued.find_element(By.CSS_SELECTOR, "button.link").click()
    shown = [texts(r.find_elements(By.TAG_NAME, "td")) for r in rescued.find_elements(By.CSS_SELECTOR, "table.candidates tr.cand")]
    cand_texts = texts(rescued.find_elements(By.CSS_SELECTOR, "table.candidates tr.cand-text td"))
    expected = candidates("kvrescue", "helper", 0.88, "repetition", len(TRAJECTORIES["kvrescue"][0][2][1][1].split()) + 2)
    assert shown == [
        [c.source, "—" if c.score is None else f"{c.score:.3f}", str(c.tokens), c.finish,
         "—" if c.max_mean_entropy is None else f"{c.max_mean_entropy:.2f}",
         "—" if c.min_gzip_ratio is None else f"{c.min_gzip_ratio:.3f}",
         "—" if c.fired_at is None else str(c.fired_at)] for c in expected]
    assert cand_texts == ["committed: the step's text" if c.committed else c.text for c in expected]
    screenshot = os.environ.get("KVRESCUE_VIEW_SCREENSHOT")
    if screenshot:  # README's picture: KVRESCUE_VIEW_SCREENSHOT=docs/view.png pytest tests/view/test_view.py
        browser.set_window_size(1400, 860)
        browser.save_screenshot(screenshot)


def test_maths_is_drawn_by_katex_and_hostile_maths_stays_inert(browser, page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    seen = lambda selector: WebDriverWait(browser, 30).until(  # noqa: E731 (drawn once in view)
        lambda d: d.find_elements(By.CSS_SELECTOR, selector))
    open_view(browser, page, "#problems")
    browser.find_element(By.NAME, "search").send_keys("simplify")
    seen("#problem-list td.problem-text .math .katex")
    open_view(browser, page, "#p/math500/123")
    seen("#side-by-side .step-text .math .katex")  # "It is $1$."
    problem = browser.find_element(By.ID, "problem-text")
    maths = problem.find_elements(By.CSS_SELECTOR, "[data-tex]")
    assert [(m.get_attribute("class"), m.get_attribute("data-tex")) for m in maths] == HOSTILE_MATHS
    assert all(m.find_elements(By.CSS_SELECTOR, ".katex") for m in maths[:-1])
    assert maths[0].find_elements(By.CSS_SELECTOR, ".katex-html .mfrac")  # \frac{1}{2} drawn as a fraction
    # LaTeX that does not parse is shown as its text, with KaTeX's reason on hover.
    assert maths[-1].get_attribute("textContent") == "$\\frac{$" and not maths[-1].find_elements(By.XPATH, "*")
    assert "KaTeX parse error" in maths[-1].get_attribute("title")
    # Neither the text nor KaTeX's markup of it made an element that loads, links, runs or names anything.
    assert not problem.find_elements(By.CSS_SELECTOR, "img, a, script, iframe, b, [href], [src], [onerror], [id]")
    assert browser.execute_script("return document.getElementById('x')") is None
    assert browser.execute_script("return window.pwned") is None
    # "LaTeX source" shows every text as it is, nothing drawn.
    browser.find_element(By.ID, "show-source").click()
    WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "return document.body.dataset.drawn === 'p/math500/123' && document.getElementById('problem-text') !== null"))
    assert browser.find_element(By.ID, "problem-text").get_attribute("textContent") == HOSTILE
    assert texts(browser.find_elements(By.CSS_SELECTOR, "#side-by-side .step-text")) == ["It is $1$."]
    assert not browser.find_elements(By.CSS_SELECTOR, "#app .katex, #app [data-tex]")


def test_maths_is_drawn_once_it_comes_into_view(browser, page):
    from selenium.webdriver.support.ui import WebDriverWait

    first, last = (f'#side-by-side tr[data-step="{i}"] td.step:nth-child({column}) .step-text'
                   for i, column in ((0, 2), (3, 4)))  # full's "... $3 + 4 = 7$ ...", kvrescue's "... \\boxed{18} ..."
    drawn = lambda selector: browser.execute_script(  # noqa: E731
        f"return document.querySelectorAll('{selector} .katex').length")
    browser.set_window_size(1500, 200)
    try:
        open_view(browser, page, "#p/gsm8k/0")
        browser.execute_script(f"document.querySelector('{first}').scrollIntoView()")
        WebDriverWait(browser, 30).until(lambda d: drawn(first) == 1)
        # The last step lies beyond the 1.5 screens drawn, and is not drawn while the first one is.
        assert browser.execute_script(f"return document.querySelector('{last}').getBoundingClientRect().top"
                                      " > 1.5 * innerHeight") and drawn(last) == 0
        assert sources(browser, last) == [TRAJECTORIES["kvrescue"][0][2][3][1]]
        browser.execute_script(f"document.querySelector('{last}').scrollIntoView()")
        WebDriverWait(browser, 30).until(lambda d: drawn(last) == 1)
        assert sources(browser, last) == [TRAJECTORIES["kvrescue"][0][2][3][1]]
    finally:
        browser.set_window_size(1500, 1000)


# (text, its maths as (source, LaTeX drawn, display)): every delimiter, dollars that are money, openers left open.
MATH_CASES = [
    ("no maths: $5 and $10, \\$x\\$ and 3 $ or $ 4", []),
    ("$$x^2$$ then \\[y\\] and \\(z\\), $w$.", [("$$x^2$$", "x^2", True), ("\\[y\\]", "y", True),
                                               ("\\(z\\)", "z", False), ("$w$", "w", False)]),
    ("so \\boxed{\\frac{1}{2}} and \\begin{align*}a&=b\\end{align*}!",
     [("\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}}", False),
      ("\\begin{align*}a&=b\\end{align*}", "\\begin{align*}a&=b\\end{align*}", True)]),
    ("$a \\boxed{1}$ and $b\n\nc$ and $1$2.", [("$a \\boxed{1}$", "a \\boxed{1}", False)]),
    ("left open: \\( and \\[ and \\boxed{x and \\begin{align} and $$y", []),
]


def test_maths_segments_cover_the_text(browser, page):
    open_view(browser, page)
    for text, expected in MATH_CASES:
        segments = browser.execute_script("return mathSegments(arguments[0])", text)
        assert "".join(s if isinstance(s, str) else s["source"] for s in segments) == text
        assert [(s["source"], s["tex"], s["display"]) for s in segments if not isinstance(s, str)] == expected, text


def page_policy(html: str) -> dict[str, str]:
    """The page's Content-Security-Policy, directive by directive."""
    policy = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', html).group(1)
    return {d.split()[0]: " ".join(d.split()[1:]) for d in policy.split(";") if d.strip()}


def test_the_policy_allows_only_the_pages_own_script_and_no_forms_or_base(page):
    import hashlib

    html = page.read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)  # KaTeX's and the page's
    assert len(scripts) == 2 and "katex" in scripts[0][:2000] and "route()" in scripts[1]
    policy = page_policy(html)
    assert policy["script-src"] == " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                                            for s in scripts)
    assert policy["form-action"] == "'none'" and policy["base-uri"] == "'none'" and policy["default-src"] == "'none'"
    assert policy["font-src"] == "data:" and not any("unsafe" in v for k, v in policy.items() if k != "style-src")


def test_an_injected_inline_script_does_not_run(browser, page, tmp_path):
    injected = tmp_path / "injected.html"
    injected.write_text(page.read_text(encoding="utf-8").replace("</body>", "<script>window.injected = 1</script></body>"),
                        encoding="utf-8")
    browser.get_log("browser")
    open_view(browser, injected)
    assert browser.execute_script("return window.injected") is None
    blocked = [entry["message"] for entry in browser.get_log("browser")]  # the policy says so on the console
    assert len(blocked) == 1 and "Content Security Policy" in blocked[0]


def test_a_malformed_fragment_still_draws_the_report(browser, page):
    from selenium.webdriver.common.by import By

    open_view(browser, page, "#%E0")
    assert browser.execute_script("return document.body.dataset.drawn") == "%E0"
    assert browser.find_elements(By.CSS_SELECTOR, "#report-tables section")


def test_the_pages_files_are_package_data():
    """An installed wheel has every file the page is made of (the template's and KaTeX's)."""
    import tomllib
    from fnmatch import fnmatch

    import kvrescue.view

    folder = Path(kvrescue.view.__file__).parent
    globs = tomllib.loads((folder.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    made_of = [p.relative_to(folder).as_posix() for p in folder.rglob("*")
               if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert "katex/katex.min.js" in made_of and "katex/fonts/KaTeX_Main-Regular.woff2" in made_of
    assert [f for f in made_of if not any(fnmatch(f, g) for g in globs["kvrescue.view"])] == []
