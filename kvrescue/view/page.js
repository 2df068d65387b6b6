"use strict";
// kvrescue view: the report, a problem list across runs, and a problem page per (bench, idx).
// Every text that comes from a trace or a problem file is set with textContent, never parsed as markup; its maths
// is drawn by KaTeX (inlined before this script), whose markup escapes the text and, untrusted, links nothing.

const METHOD_ORDER = ["full", "helper", "bon", "interleave", "kvrescue"];
const PAGE_ROWS = 100;
const STEP_ROWS = 100;
// readyAt: ms from navigation start to the first view drawn; source: texts shown as LaTeX source; mathsAt: below.
const KV = { data: null, readyAt: null, source: false, mathsAt: null };
window.KV = KV;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

async function unpack(id) {
  const binary = atob(document.getElementById(id).textContent.trim());
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function methodRank(method) {
  const i = METHOD_ORDER.indexOf(method);
  return i < 0 ? METHOD_ORDER.length : i;
}

function index(data) {
  data.traceOf = data.rows.map(rows => new Map(rows.map(t => [t.idx, t])));  // what the list shows of each trace
  data.runOrder = data.runs.slice().sort((a, b) =>
    methodRank(a.method) - methodRank(b.method) || a.method.localeCompare(b.method) ||
    (a.budget ?? -1) - (b.budget ?? -1) || a.n - b.n || a.seed - b.seed || a.bench.localeCompare(b.bench));
  // A column of the problem list is a run label; its cell for a problem is the run of that label on the problem's bench.
  data.labels = [...new Set(data.runOrder.map(r => r.label))];
  data.runAt = new Map(data.runs.map(r => [r.bench + "\u0000" + r.label, r]));
  data.benches = [...new Set(data.problems.map(p => p.bench))].sort();
  data.methods = [...new Set(data.runOrder.map(r => r.method))];
}

const chunks = new Map();  // "run-chunk" -> Promise of Map idx -> full trace

function detail(runId, idx) {
  const key = `${runId}-${Math.floor(idx / KV.data.chunk)}`;
  if (!chunks.has(key)) chunks.set(key, unpack("kv-run-" + key).then(traces => new Map(traces.map(t => [t.idx, t]))));
  return chunks.get(key).then(traces => traces.get(idx));
}

// ------------------------------------------------------------------------------------------
// Formatting
// ------------------------------------------------------------------------------------------

function score(value) {
  return value === null || value === undefined ? "—" : value.toFixed(3);
}

function num(value, digits) {
  return value === null || value === undefined ? "—" : value.toFixed(digits);
}

function verdict(run, trace) {
  if (!trace) return el("span", { class: "muted", title: "not in this run" }, "–");
  if (trace.stop === "skipped" || trace.stop === "failed")
    return el("span", { class: "muted verdict", title: trace.skip_reason }, trace.stop);
  if (run.synthetic) return el("span", { class: "muted verdict", title: "synthetic run: no accuracy" }, "n/a");
  return trace.correct ? el("span", { class: "verdict ok", title: "correct" }, "✓")
                       : el("span", { class: "verdict bad", title: "incorrect" }, "✗");
}

function badge(source) {
  return el("span", { class: "badge " + source }, source);
}

// ------------------------------------------------------------------------------------------
// Maths: the LaTeX of problems, steps and candidates drawn by KaTeX
// ------------------------------------------------------------------------------------------

// No \href, \url, \includegraphics or \html... (trust: false); what does not parse throws and is shown as text;
// sizes and macro expansion bounded (a model's output can ask for anything).
const KATEX = { throwOnError: true, trust: false, strict: "ignore", maxSize: 20, maxExpand: 1000 };
const MATH_OPENER = /\\\$|\$\$|\$|\\\(|\\\[|\\begin\{([A-Za-z]+\*?)\}|\\boxed\{/g;
const drawnMaths = new Map();  // display flag + LaTeX -> { html } from KaTeX or { error }

// Where a $...$ opened at `body` closes (the index of its $), or -1: as Pandoc reads TeX maths, it opens before
// a non-space and closes after one, not before a digit ("costs $5 and $10" holds no maths), within a paragraph.
function inlineDollarClose(text, body) {
  if (body >= text.length || /\s/.test(text[body])) return -1;
  const paragraph = text.indexOf("\n\n", body);
  const limit = paragraph < 0 ? text.length : paragraph;
  for (let i = text.indexOf("$", body); i >= 0 && i < limit; i = text.indexOf("$", i + 1))
    if (text[i - 1] !== "\\" && !/\s/.test(text[i - 1]) && !/[0-9]/.test(text[i + 1] || "")) return i;
  return -1;
}

// The index of the } that closes the { before `body`, or -1.
function closingBrace(text, body) {
  for (let i = body, depth = 1; i < text.length; i++) {
    if (text[i] === "\\") i++;
    else if (text[i] === "{") depth++;
    else if (text[i] === "}" && --depth === 0) return i;
  }
  return -1;
}

// The maths whose opener `m` matched: [its LaTeX, the index after its closer, display?], or null without a closer.
function mathAt(text, m) {
  const [open, env] = m, start = m.index, body = start + open.length;
  if (open === "\\$") return null;
  if (open === "$") {
    const close = inlineDollarClose(text, body);
    return close < 0 ? null : [text.slice(body, close), close + 1, false];
  }
  if (env || open === "\\boxed{") {  // the whole \begin{env}...\end{env} or \boxed{...} is the LaTeX
    const close = env ? text.indexOf(`\\end{${env}}`, body) : closingBrace(text, body);
    const after = env ? close + `\\end{${env}}`.length : close + 1;
    return close < 0 ? null : [text.slice(start, after), after, Boolean(env)];
  }
  const closer = { "$$": "$$", "\\(": "\\)", "\\[": "\\]" }[open];
  const close = text.indexOf(closer, body);
  return close <= body ? null : [text.slice(body, close), close + closer.length, open !== "\\("];
}

// The text cut into plain strings and maths { source, tex, display }: $...$, $$...$$, \(...\), \[...\],
// \begin{env}...\end{env} and a \boxed{...} outside them; an opener without its closer stays text.
function mathSegments(text) {
  const out = [];
  let done = 0;
  MATH_OPENER.lastIndex = 0;
  for (let m; (m = MATH_OPENER.exec(text)) !== null;) {
    const found = mathAt(text, m);
    if (!found) continue;
    const [tex, after, display] = found;
    if (m.index > done) out.push(text.slice(done, m.index));
    out.push({ source: text.slice(m.index, after), tex, display });
    done = MATH_OPENER.lastIndex = after;
  }
  if (done < text.length) out.push(text.slice(done));
  return out;
}

function katexHtml(tex, display) {
  const key = (display ? "D" : "I") + tex;
  if (!drawnMaths.has(key)) {
    let drawn;
    try { drawn = { html: katex.renderToString(tex, { ...KATEX, displayMode: display }) }; }
    catch (err) { drawn = { error: String(err && err.message || err) }; }
    if (drawnMaths.size >= 20000) drawnMaths.clear();
    drawnMaths.set(key, drawn);
  }
  return drawnMaths.get(key);
}

// One piece of maths as KaTeX draws it (its source in data-tex), or its source as text when KaTeX cannot.
function mathNode(segment, inline) {
  const drawn = katexHtml(segment.tex, segment.display && !inline);
  if (drawn.error)
    return el("span", { class: "math-error", title: drawn.error, "data-tex": segment.source }, segment.source);
  const node = el("span", { class: "math", "data-tex": segment.source });
  node.innerHTML = drawn.html;  // KaTeX's markup: the text escaped; no link, id, class or free-form style from it
  return node;
}

// A text's nodes: its maths drawn (inline: display maths drawn inline too, for one-line cells), the rest as text;
// the text as it is when the LaTeX source is asked for.
function texNodes(text, inline) {
  if (KV.source || !text) return [text];
  return mathSegments(text).map(s => typeof s === "string" ? s : mathNode(s, inline));
}

// A text's maths is drawn when its element comes near the viewport (a long list or problem page draws what is
// seen; the element shows the text as it is until then); KV.mathsAt: when maths was last drawn. A view that
// replaces its elements first forgets the old ones (mathsInView.disconnect()).
const mathsLater = new WeakMap();  // element -> [text, inline]
const mathsInView = new IntersectionObserver(entries => {
  for (const entry of entries.filter(e => e.isIntersecting)) {
    mathsInView.unobserve(entry.target);
    const [text, inline] = mathsLater.get(entry.target);
    entry.target.replaceChildren(...texNodes(text, inline));
  }
  KV.mathsAt = performance.now();
}, { rootMargin: "50% 0px" });

function withMaths(node, text, inline) {
  node.append(text);
  if (!KV.source && /[$\\]/.test(text)) {
    mathsLater.set(node, [text, inline]);
    mathsInView.observe(node);
  }
  return node;
}

// An answer is LaTeX without delimiters ("\frac{3}{4}"): drawn as one piece of maths unless it has its own.
function answerNodes(answer) {
  if (KV.source || !answer || /\$|\\\(|\\\[/.test(answer)) return texNodes(answer, true);
  return [mathNode({ source: answer, tex: answer, display: false }, true)];
}

// ------------------------------------------------------------------------------------------
// Report
// ------------------------------------------------------------------------------------------

function showReport(app, data) {
  const plot = el("section", { class: "plot" }, el("h3", {}, "Accuracy vs KV budget"));
  if (data.plot) {
    const holder = el("div");
    holder.innerHTML = data.plot;  // made by report.plot (matplotlib), not from trace text
    plot.append(holder);
  } else {
    plot.append(el("p", { class: "muted" }, "No plot: " + data.plot_note));
  }
  const tables = el("div", { id: "report-tables" });
  tables.innerHTML = data.tables;  // made by view.data.tables_html, every cell escaped
  app.append(el("h2", {}, "Report"),
             el("p", { class: "muted" }, "The numbers of kvrescue report, from the same code; * marks runs in progress."),
             plot, tables);
}

// ------------------------------------------------------------------------------------------
// Problem list
// ------------------------------------------------------------------------------------------

const listState = { bench: "", method: "", verdict: "any", search: "", page: 0 };

function shownLabels(data) {
  return data.labels.filter(label => data.runOrder.some(r => r.label === label &&
    (!listState.method || r.method === listState.method) && (!listState.bench || r.bench === listState.bench)));
}

function cellsOf(data, problem, labels) {
  return labels.map(label => {
    const run = data.runAt.get(problem.bench + "\u0000" + label);
    return { run, trace: run ? data.traceOf[run.id].get(problem.idx) : undefined };
  });
}

function keep(problem, cells) {
  const needle = listState.search.trim().toLowerCase();
  if (listState.bench && problem.bench !== listState.bench) return false;
  if (needle && !(String(problem.idx) === needle || problem.problem.toLowerCase().includes(needle) ||
                  problem.gt.toLowerCase().includes(needle))) return false;
  const graded = cells.filter(c => c.trace && !c.run.synthetic).map(c => c.trace.correct);
  if (listState.verdict === "correct") return graded.length > 0 && graded.every(v => v);
  if (listState.verdict === "incorrect") return graded.length > 0 && graded.every(v => !v);
  if (listState.verdict === "disagree") return graded.includes(true) && graded.includes(false);
  return cells.some(c => c.trace);
}

function select(name, options, value, onchange) {
  return el("label", {}, name + " ",
    el("select", { name, onchange: e => onchange(e.target.value) },
       options.map(([v, text]) => el("option", { value: v, selected: v === value }, text))));
}

function showProblems(app, data) {
  const rerender = patch => { Object.assign(listState, patch); route(); };
  const search = el("input", { type: "search", name: "search", placeholder: "search problem text, answer or idx",
                               value: listState.search });
  search.addEventListener("input", () => { listState.search = search.value; listState.page = 0; drawTable(); });
  const filters = el("div", { class: "filters" },
    select("bench", [["", "all benches"], ...data.benches.map(b => [b, b])], listState.bench,
           v => rerender({ bench: v, page: 0 })),
    select("method", [["", "all methods"], ...data.methods.map(m => [m, m])], listState.method,
           v => rerender({ method: v, page: 0 })),
    select("verdict", [["any", "any verdict"], ["correct", "correct in every run shown"],
                       ["incorrect", "incorrect in every run shown"], ["disagree", "runs disagree"]],
           listState.verdict, v => rerender({ verdict: v, page: 0 })),
    search);
  const holder = el("div");
  app.append(el("h2", {}, "Problems"), filters, holder);

  function drawTable() {
    mathsInView.disconnect();
    holder.replaceChildren();
    const labels = shownLabels(data);
    const rows = [];
    for (const problem of data.problems) {
      const cells = cellsOf(data, problem, labels);
      if (keep(problem, cells)) rows.push([problem, cells]);
    }
    const pages = Math.max(1, Math.ceil(rows.length / PAGE_ROWS));
    listState.page = Math.min(listState.page, pages - 1);
    const first = listState.page * PAGE_ROWS;
    const pager = el("div", { class: "pager" },
      el("button", { disabled: listState.page === 0, onclick: () => { listState.page--; drawTable(); } }, "‹ prev"),
      el("span", { id: "list-count" }, rows.length ? `${first + 1}–${Math.min(first + PAGE_ROWS, rows.length)} of ${rows.length} problems`
                                                   : "no problem matches"),
      el("button", { disabled: listState.page >= pages - 1, onclick: () => { listState.page++; drawTable(); } }, "next ›"));
    const head = el("tr", {}, el("th", {}, "bench"), el("th", {}, "idx"), el("th", {}, "problem"), el("th", {}, "answer"),
                    labels.map(label => el("th", { title: "verdict, steps, base / helper tokens" }, label)));
    const body = rows.slice(first, first + PAGE_ROWS).map(([problem, cells]) =>
      el("tr", { "data-bench": problem.bench, "data-idx": problem.idx,
                 onclick: () => { location.hash = `#p/${encodeURIComponent(problem.bench)}/${problem.idx}`; } },
         el("td", {}, problem.bench), el("td", { class: "num" }, problem.idx),
         withMaths(el("td", { class: "problem-text", title: problem.problem }), problem.problem, true),
         el("td", { class: "tex" }, answerNodes(problem.gt)),
         cells.map(({ run, trace }) => el("td", { class: "num" },
           run ? verdict(run, trace) : "",
           trace ? el("div", { class: "cell-stats" },
                      `${trace.n_steps} st · ${trace.tokens.base} / ${trace.tokens.helper} tok`) : ""))));
    holder.append(pager, el("table", { id: "problem-list" }, el("thead", {}, head), el("tbody", {}, body)));
  }
  drawTable();
}

// ------------------------------------------------------------------------------------------
// Problem page
// ------------------------------------------------------------------------------------------

const pickedRuns = new Map();  // "bench/idx" -> Set of run ids shown side by side

// The base cache row's length after each committed step, on a scale shared by the runs shown (`top`),
// a dot per step coloured by its source, the budget B dashed.
function cacheChart(run, trace, top) {
  const rows = trace.steps.map(s => s.base_rows);
  if (!rows.length || rows.some(v => v === null || v === undefined))
    return el("div", { class: "muted chart-note" },
              run.method === "helper" ? "no base model" : "base cache length per step not recorded in this trace");
  const width = 300, height = 64, pad = 6;
  const x = i => pad + (rows.length === 1 ? 0 : i * (width - 2 * pad) / (rows.length - 1));
  const y = v => height - 4 - v * (height - 18) / top;
  const chart = svgEl("svg", { class: "chart", width, height, viewBox: `0 0 ${width} ${height}` });
  if (run.budget) chart.append(svgEl("line", { class: "budget", x1: pad, x2: width - pad, y1: y(run.budget), y2: y(run.budget) }));
  chart.append(svgEl("polyline", { points: rows.map((v, i) => `${x(i)},${y(v)}`).join(" ") }));
  if (rows.length <= 200)
    rows.forEach((v, i) => chart.append(svgEl("circle", { class: trace.steps[i].source, cx: x(i), cy: y(v), r: 2.2 })));
  const label = svgEl("text", { x: pad, y: 9 });
  label.textContent = `base cache rows after each step (max ${Math.max(...rows)}${run.budget ? ", B = " + run.budget : ""})`;
  chart.append(label);
  return chart;
}

// One row per candidate, its text in a full-width row below it.
function candidatesTable(cands) {
  const unrecorded = cands.some(c => !c.committed && (c.text === null || c.text === undefined));
  return el("table", { class: "candidates" },
    el("thead", {}, el("tr", {}, ["source", "score", "tokens", "finish", "max H̄", "min ρ", "fired at"].map(h => el("th", {}, h)))),
    el("tbody", {}, cands.flatMap(c => [
      el("tr", { class: "cand" + (c.committed ? " committed" : "") },
        el("td", {}, badge(c.source)), el("td", { class: "num" }, score(c.score)), el("td", { class: "num" }, c.tokens),
        el("td", { class: c.finish === "entropy" || c.finish === "repetition" ? "fired" : null }, c.finish),
        el("td", { class: "num" }, num(c.max_mean_entropy, 2)), el("td", { class: "num" }, num(c.min_gzip_ratio, 3)),
        el("td", { class: "num" }, c.fired_at ?? "—")),
      el("tr", { class: "cand-text" + (c.committed ? " committed" : "") },
        el("td", { colspan: 7 }, c.committed ? el("span", { class: "muted" }, "committed: the step's text")
                                             : c.text === null || c.text === undefined ? el("div", { class: "tex" }, "—")
                                             : withMaths(el("div", { class: "tex" }), c.text)))])),
    !KV.data.candidate_texts ? el("caption", { class: "muted" }, "Candidates' texts were left out of this page (--no-candidate-texts).")
      : unrecorded ? el("caption", { class: "muted" }, "This trace was written before candidates' texts were recorded.") : null);
}

function stepCell(trace, i) {
  if (!trace || i >= trace.steps.length) return el("td", { class: "step empty" });
  const step = trace.steps[i];
  const cands = trace.candidates[i] || [];
  const stopped = cands.filter(c => c.finish === "entropy" || c.finish === "repetition").length;
  const details = el("div", { class: "cands", hidden: true });
  const toggle = el("button", { class: "link", onclick: () => {
    if (!details.firstChild) details.append(candidatesTable(cands));
    details.hidden = !details.hidden;
  } }, `${cands.length} candidates`);
  return el("td", { class: "step " + step.source, "data-source": step.source },
    el("div", { class: "step-meta" }, badge(step.source),
       el("span", { class: "score", title: "score of the committed candidate" }, "score " + score(step.score)),
       el("span", { class: "muted" }, `${step.tokens} tok`),
       stopped ? el("span", { class: "fired", title: "base candidates the detector stopped" }, `detector stopped ${stopped}`) : null,
       toggle),
    withMaths(el("div", { class: "tex step-text" }), step.text),
    details);
}

async function showProblem(app, data, bench, idx, current) {
  const problem = data.problems.find(p => p.bench === bench && p.idx === idx);
  if (!problem) { app.append(el("p", {}, `No problem ${bench} #${idx} in these runs.`)); return; }
  const runs = data.runOrder.filter(r => r.bench === bench && data.traceOf[r.id].has(idx));
  const key = bench + "/" + idx;
  if (!pickedRuns.has(key)) {
    const firstOfMethod = runs.filter((r, i) => runs.findIndex(o => o.method === r.method) === i);
    pickedRuns.set(key, new Set((runs.length <= 4 ? runs : firstOfMethod).map(r => r.id)));
  }
  const picked = pickedRuns.get(key);
  app.append(el("p", {}, el("a", { href: "#problems" }, "‹ all problems")),
    el("div", { class: "problem-head" },
       el("h2", {}, `${bench} #${idx}`),
       el("div", { class: "tex", id: "problem-text" }, texNodes(problem.problem)),
       el("div", {}, "answer: ", el("span", { class: "tex" }, answerNodes(problem.gt)), el("span", { class: "muted" }, "  normalised: "),
          el("span", { class: "tex" }, problem.gt_norm))),
    el("div", { class: "run-picker" }, "side by side:", runs.map(r => el("label", {},
      el("input", { type: "checkbox", checked: picked.has(r.id), "data-run": r.id, onchange: e => {
        e.target.checked ? picked.add(r.id) : picked.delete(r.id); route();
      } }), " " + r.label))));
  const shown = runs.filter(r => picked.has(r.id));
  const traces = await Promise.all(shown.map(r => detail(r.id, idx)));
  if (!current()) return;  // another view was asked for meanwhile
  const longest = Math.max(0, ...traces.map(t => t.steps.length));
  const top = Math.max(1, ...shown.map(r => r.budget || 0),
                       ...traces.flatMap(t => t.steps.map(s => s.base_rows || 0)));
  const head = el("tr", {}, el("th", { class: "stepno" }, "step"), shown.map((r, j) => {
    const t = traces[j];
    return el("th", { class: "run", "data-run": r.id },
      el("div", {}, r.label, " ", verdict(r, t)),
      el("div", { class: "cell-stats" }, `pred ${JSON.stringify(t.pred)} · stop ${t.stop} · ${t.n_steps} steps`),
      el("div", { class: "cell-stats" }, `tokens: base ${t.tokens.base}, helper ${t.tokens.helper}, prm ${t.tokens.prm}` +
                                        ` · peak base rows ${t.peak_base_rows}`),
      r.in_progress ? el("div", { class: "cell-stats" }, "* in progress: " + r.in_progress) : null,
      cacheChart(r, t, top));
  }));
  const body = el("tbody");
  let drawn = 0;
  const more = el("button", { onclick: () => drawSteps() });
  function drawSteps() {
    const upto = Math.min(longest, drawn + STEP_ROWS);
    for (let i = drawn; i < upto; i++)
      body.append(el("tr", { "data-step": i }, el("td", { class: "stepno" }, i + 1), traces.map(t => stepCell(t, i))));
    drawn = upto;
    more.hidden = drawn >= longest;
    more.textContent = `show ${Math.min(STEP_ROWS, longest - drawn)} more steps (${longest - drawn} left)`;
  }
  drawSteps();
  app.append(el("div", { class: "side" }, el("table", { id: "side-by-side" }, el("thead", {}, head), body)), more);
}

// ------------------------------------------------------------------------------------------
// Routing
// ------------------------------------------------------------------------------------------

let routed = 0;

// The location's fragment, decoded; a malformed escape (#%E0) is kept as it is (it then names no view: the report).
function fragment() {
  const raw = location.hash.slice(1);
  try { return decodeURIComponent(raw); } catch (err) { return raw; }
}

// Draws the view the location's fragment names; document.body.dataset.drawn names it once it is complete.
async function route() {
  const mine = ++routed;
  const app = document.getElementById("app");
  mathsInView.disconnect();
  app.replaceChildren();
  delete document.body.dataset.drawn;
  const hash = fragment();
  const match = hash.match(/^p\/(.+)\/(\d+)$/);
  document.getElementById("nav-report").classList.toggle("current", hash === "" || hash === "report");
  document.getElementById("nav-problems").classList.toggle("current", hash.startsWith("p"));
  if (match) await showProblem(app, KV.data, match[1], Number(match[2]), () => mine === routed);
  else if (hash === "problems") showProblems(app, KV.data);
  else showReport(app, KV.data);
  if (mine === routed) document.body.dataset.drawn = hash;
}

unpack("kv-data").then(async data => {
  index(data);
  KV.data = data;
  window.addEventListener("hashchange", () => { route(); window.scrollTo(0, 0); });
  document.getElementById("show-source").addEventListener("change", e => {
    KV.source = e.target.checked;
    document.body.classList.toggle("latex-source", KV.source);
    route();
  });
  await route();
  KV.readyAt = performance.now();
  document.body.dataset.ready = "true";
}).catch(err => {
  document.getElementById("app").replaceChildren(el("p", { class: "bad" }, "Could not unpack the runs: " + err));
  document.body.dataset.ready = "error";
});
