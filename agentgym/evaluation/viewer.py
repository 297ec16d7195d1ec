"""One self-contained HTML file to browse a run's episodes offline (``agentgym view``).

Why a single file: it opens from disk or an artifact store with no server, no CDN and no network
(inline CSS and JS only), and can be attached to a report. The run's rows are embedded once as
JSON in ``<script type="application/json" id="agentgym-data">`` with every ``<`` written as
``\\u003c``, so no observation (``</script>``, ``<!--``) can end the tag early; the script parses
it and builds DOM lazily: the episode list is paginated (``PAGE_SIZE`` rows at a time) and only
the selected episode's turns become elements. Text is inserted with ``textContent``, never as
HTML. ``run.html#episode=<id>`` opens with that episode selected (clicking one sets it).

Size bound: at most ``max_episodes`` episodes (default ``DEFAULT_MAX_EPISODES``), taken from the
newest iterations first, with all of their turns; the file grows with the text of those turns
(roughly episodes x turns x observation length). The per-iteration table always covers the whole
run. The data's ``omitted_episodes`` says how many were left out.

Numbers: every number the page shows is a string made in Python by
``agentgym.evaluation.numbers.fmt_num`` (each row's ``shown``), the rule ``agentgym inspect``
uses, so the two read the same (0.8125 is 0.813 in both); the script never rounds. The raw values
stay in the rows for anyone reading the data.

Layout: each table sits in a wrapper that scrolls sideways inside its card, so no width of window
pushes a column out of sight; below 900 px the two panes stack. A legend under the episode list
says how episode ids are made (``inspect_run.EPISODE_ID_FORMS``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from agentgym.evaluation.inspect_run import (
    EPISODE_COLUMNS,
    EPISODE_ID_FORMS,
    ITERATION_COLUMNS,
    TURN_COLUMNS,
    episode_id_parts,
    iteration_table,
    list_episodes,
)
from agentgym.evaluation.numbers import fmt_num
from agentgym.store.trajectory_store import TrajectoryStore

__all__ = ["DEFAULT_MAX_EPISODES", "PAGE_SIZE", "embed_json", "run_data", "render_html",
           "write_html"]

DEFAULT_MAX_EPISODES = 5000
PAGE_SIZE = 200


def _clean(v: Any) -> Any:
    """NaN/inf as ``null``: JSON has no NaN and the browser's JSON.parse rejects it."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _episode_row(e: dict[str, Any]) -> dict[str, Any]:
    row = {k: _clean(e[k]) for k in EPISODE_COLUMNS}
    parts = episode_id_parts(e["episode_id"])
    row["shown"] = {"reward": fmt_num(e["reward"]),
                    "id": " \u00b7 ".join(f"{k} {v}" for k, v in parts) if parts else ""}
    return row


def run_data(store: TrajectoryStore, max_episodes: int = DEFAULT_MAX_EPISODES) -> dict[str, Any]:
    """What the page shows: ``iterations`` (``iteration_table``), ``episodes`` (newest iterations
    first, at most ``max_episodes``), ``turns`` (episode id -> its turns in order). Each row
    carries the raw values and ``shown``, the strings the page prints for its numbers
    (``fmt_num``; an episode's ``shown.id`` names its id's parts); ``iteration_columns`` and
    ``episode_id_forms`` are the table's headers and the id legend."""
    eps = list_episodes(store)
    kept = eps[: max(int(max_episodes), 0)]
    keys = sorted({(e["stage"], e["iteration"]) for e in kept})
    ids = {e["episode_id"] for e in kept}
    turns: dict[str, list[dict]] = {e["episode_id"]: [] for e in kept}
    for s, i in keys:
        t = store.read_arrow("turns", stage=s, iteration=i, columns=["episode_id", *TURN_COLUMNS])
        for r in t.to_pylist():
            eid = r.pop("episode_id")
            if eid in ids:
                row = {k: _clean(r[k]) for k in TURN_COLUMNS}
                row["shown"] = {"reward": fmt_num(r["reward"])}
                turns[eid].append(row)
    for lst in turns.values():
        lst.sort(key=lambda r: r["turn"])
    return {
        "run_id": store.run_id,
        "root": store.spec()["root"],
        "iteration_columns": [{"key": c.key, "name": c.name, "help": c.help} for c in ITERATION_COLUMNS],
        "episode_id_forms": [{"form": f, "example": x, "meaning": m} for f, x, m in EPISODE_ID_FORMS],
        "iterations": [{**{k: _clean(v) for k, v in r.items()},
                        "shown": {c.key: fmt_num(r[c.key]) for c in ITERATION_COLUMNS}}
                       for r in iteration_table(store)],
        "episodes": [_episode_row(e) for e in kept],
        "turns": turns,
        "omitted_episodes": len(eps) - len(kept),
    }


def embed_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element: every ``<`` escaped (valid JSON either way)."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).replace("<", "\\u003c")


def render_html(store: TrajectoryStore, max_episodes: int = DEFAULT_MAX_EPISODES) -> str:
    """The whole page as one string."""
    return _page(run_data(store, max_episodes))


def _page(data: dict[str, Any]) -> str:
    title = f"agentgym run {data['run_id']}".replace("&", "&amp;").replace("<", "&lt;")
    head, tail = _PAGE.split("__DATA__")  # the data goes in last, so nothing in it is substituted
    return (head.replace("__TITLE__", title) + embed_json(data)
            + tail.replace("__PAGE_SIZE__", str(PAGE_SIZE)))


def write_html(store: TrajectoryStore, path: str | Path,
               max_episodes: int = DEFAULT_MAX_EPISODES) -> dict[str, int]:
    """Write the page to ``path``; returns ``{"bytes", "episodes", "omitted_episodes"}``."""
    data = run_data(store, max_episodes)
    payload = _page(data).encode("utf-8")
    Path(path).write_bytes(payload)
    return {"bytes": len(payload), "episodes": len(data["episodes"]),
            "omitted_episodes": data["omitted_episodes"]}


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
*,*::before,*::after{box-sizing:border-box}
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:8px 16px;background:#234;color:#fff;overflow-wrap:anywhere}
header h1{font-size:17px;margin:0}
main{display:flex;gap:12px;padding:12px;align-items:flex-start}
section{background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px;min-width:0;margin-bottom:12px}
#left{flex:0 0 46%;min-width:0}#right{flex:1 1 0;min-width:0}
@media (max-width:900px){main{flex-direction:column;align-items:stretch}#left,#right{flex:none;width:100%}}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:3px 5px;border-bottom:1px solid #eee;text-align:right}
th{vertical-align:bottom;white-space:normal;font-size:12px}
td{white-space:nowrap}
th:first-child,td:first-child{text-align:left}
th[title]{cursor:help;text-decoration:underline dotted #999}
#episodes tbody tr{cursor:pointer}#episodes tbody tr:hover{background:#eef4ff}
tr.sel{background:#dde8ff!important}
.ok{color:#17702a}.bad{color:#a31515}.infra{color:#8a5a00}
.filters{display:flex;flex-wrap:wrap;gap:8px;margin:6px 0}
.legend{font-size:12px;margin:8px 0 0;overflow-wrap:anywhere}.legend dl{margin:2px 0 0}
.legend dt{font-family:ui-monospace,monospace}.legend dd{margin:0 0 4px 12px}
.turn{border-top:1px solid #ddd;padding:6px 0}
.turn h3{font-size:14px;margin:2px 0}.turn h3 span{margin-left:6px}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;margin:2px 0 6px;padding:6px;
font:12px/1.35 ui-monospace,monospace}
#detail{overflow-wrap:anywhere}
.flag{display:inline-block;padding:0 5px;margin-left:6px;border-radius:3px;background:#fde2e2;
color:#a31515;font-size:12px}
.muted{color:#777}
</style></head><body>
<header><h1 id="title"></h1><div id="where" class="muted"></div></header>
<main>
<div id="left">
<section id="iterations-card"><h2>Iterations</h2>
<div class="scroll"><table id="iterations"><thead></thead><tbody></tbody></table></div></section>
<section id="episodes-card"><h2>Episodes</h2>
<div class="filters">
<label>stage <select id="f-stage"></select></label>
<label>iteration <select id="f-iteration"></select></label>
<label>environment <select id="f-env"></select></label>
<label>outcome <select id="f-outcome"><option value="">all</option><option value="success">success</option>
<option value="failed">failed</option><option value="infra">infra error</option></select></label>
</div>
<div id="count" class="muted"></div>
<div class="scroll"><table id="episodes"><thead><tr><th>episode</th><th>env</th><th>task</th><th>stage/it</th>
<th>reward</th><th>turns</th><th>success</th></tr></thead><tbody></tbody></table></div>
<div><button id="prev">&larr; prev</button> <span id="page"></span> <button id="next">next &rarr;</button></div>
<div id="legend" class="legend muted"><strong>Episode ids</strong><dl></dl></div>
</section>
</div>
<section id="right"><div id="detail" class="muted">Click an episode to see its turns.</div></section>
</main>
<script type="application/json" id="agentgym-data">__DATA__</script>
<script>
(function(){
"use strict";
var D=JSON.parse(document.getElementById("agentgym-data").textContent);
var PAGE=__PAGE_SIZE__, page=0, shown=[], selected=null;
function el(tag,text,cls){var e=document.createElement(tag);if(text!==undefined&&text!==null)e.textContent=String(text);if(cls)e.className=cls;return e;}
function outcome(e){return e.infra_error?"infra":(e.success?"success":"failed");}
document.getElementById("title").textContent="Run "+D.run_id;
document.getElementById("where").textContent=D.root+"/"+D.run_id+(D.omitted_episodes?" \\u2014 "+D.omitted_episodes+" older episodes not embedded":"");
(function(){  // numbers arrive formatted (row.shown: agentgym.evaluation.numbers.fmt_num); none is rounded here
  var cols=D.iteration_columns;
  var tr=el("tr");cols.forEach(function(c){var th=el("th",c.name);th.title=c.help;tr.appendChild(th);});
  document.querySelector("#iterations thead").appendChild(tr);
  var tb=document.querySelector("#iterations tbody");
  D.iterations.forEach(function(r){var tr=el("tr");cols.forEach(function(c){tr.appendChild(el("td",r.shown[c.key]));});tb.appendChild(tr);});
  var lg=document.querySelector("#legend dl");
  D.episode_id_forms.forEach(function(f){lg.appendChild(el("dt",f.form));lg.appendChild(el("dd",f.example+": "+f.meaning+"."));});
})();
function options(id,values){var s=document.getElementById(id);s.appendChild(el("option","all")).value="";
  values.forEach(function(v){s.appendChild(el("option",v)).value=String(v);});s.onchange=function(){page=0;refresh();};}
function uniq(k){var seen={},out=[];D.episodes.forEach(function(e){if(!(e[k] in seen)){seen[e[k]]=1;out.push(e[k]);}});
  return out.sort(function(a,b){return typeof a==="number"?a-b:String(a).localeCompare(String(b));});}
options("f-stage",uniq("stage"));options("f-iteration",uniq("iteration"));options("f-env",uniq("env"));
document.getElementById("f-outcome").onchange=function(){page=0;refresh();};
function val(id){return document.getElementById(id).value;}
function refresh(){
  var st=val("f-stage"),it=val("f-iteration"),env=val("f-env"),oc=val("f-outcome");
  shown=D.episodes.filter(function(e){return (st===""||String(e.stage)===st)&&(it===""||String(e.iteration)===it)&&
    (env===""||e.env===env)&&(oc===""||outcome(e)===oc);});
  var pages=Math.max(1,Math.ceil(shown.length/PAGE));if(page>=pages)page=pages-1;
  var tb=document.querySelector("#episodes tbody");tb.textContent="";
  shown.slice(page*PAGE,(page+1)*PAGE).forEach(function(e){
    var tr=el("tr");tr.dataset.id=e.episode_id;if(e.episode_id===selected)tr.className="sel";
    if(e.shown.id)tr.title=e.shown.id;
    [e.episode_id,e.env,e.task_id,e.stage+"/"+e.iteration,e.shown.reward,e.num_turns].forEach(function(v){tr.appendChild(el("td",v));});
    var o=outcome(e);tr.appendChild(el("td",o==="success"?"yes":(o==="infra"?"infra error":"no"),o==="success"?"ok":(o==="infra"?"infra":"bad")));
    tr.onclick=function(){select(e);};tb.appendChild(tr);});
  document.getElementById("count").textContent=shown.length+" of "+D.episodes.length+" episodes";
  document.getElementById("page").textContent="page "+(page+1)+" / "+pages;
}
document.getElementById("prev").onclick=function(){if(page>0){page--;refresh();}};
document.getElementById("next").onclick=function(){if((page+1)*PAGE<shown.length){page++;refresh();}};
function select(e){
  selected=e.episode_id;refresh();
  try{history.replaceState(null,"","#episode="+encodeURIComponent(e.episode_id));}catch(err){}
  var d=document.getElementById("detail");d.textContent="";d.className="";
  d.appendChild(el("h2","Episode "+e.episode_id));
  if(e.shown.id)d.appendChild(el("div","id: "+e.shown.id,"muted"));
  d.appendChild(el("div",e.env+" task "+e.task_id+" \\u00b7 seed "+e.seed+" \\u00b7 stage "+e.stage+" iteration "+e.iteration+
    " \\u00b7 horizon "+e.horizon+" \\u00b7 policy version "+e.policy_version));
  d.appendChild(el("div","reward "+e.shown.reward+" \\u00b7 "+(e.success?"success":"not solved")+" \\u00b7 "+e.num_turns+" turns"+
    (e.terminated?" \\u00b7 terminated":"")+(e.truncated?" \\u00b7 truncated":""),e.success?"ok":"bad"));
  if(e.infra_error)d.appendChild(el("div","infra error: "+(e.error||"?"),"infra"));
  (D.turns[e.episode_id]||[]).forEach(function(t){
    var box=el("div",null,"turn"),h=el("h3","turn "+t.turn+" \\u00b7 reward "+t.shown.reward+" \\u00b7 "+t.gen_tokens+" tokens");
    if(t.format_error)h.appendChild(el("span","format error","flag"));
    if(t.invalid_action)h.appendChild(el("span","invalid action","flag"));
    if(t.terminated)h.appendChild(el("span","terminated","muted"));
    if(t.truncated)h.appendChild(el("span","truncated","muted"));
    box.appendChild(h);box.appendChild(el("div","observation","muted"));box.appendChild(el("pre",t.observation));
    box.appendChild(el("div","reply","muted"));box.appendChild(el("pre",t.action_text));
    box.appendChild(el("div","parsed action: "+(t.parsed_action===null?"(none)":t.parsed_action)));
    d.appendChild(box);});
}
refresh();
var want=decodeURIComponent(location.hash.replace(/^#episode=/,""));  // a link to one episode
D.episodes.forEach(function(e){if(location.hash&&e.episode_id===want)select(e);});
})();
</script></body></html>
"""
