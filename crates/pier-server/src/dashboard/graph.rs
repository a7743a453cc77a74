//! The task graph as SVG, laid out in layers by dependency: a task sits one layer below the
//! deepest task it depends on, so every edge points down, into its task's arrowhead. Each node
//! says its state (glyph and word), its attempts and how long they ran. Linear in tasks and edges.

use std::collections::{BTreeMap, HashMap};

use maud::{Markup, html};
use pier_host::{AttemptTime, TaskRow};

const W: usize = 168;
const H: usize = 44;
const GAP_X: usize = 16;
const GAP_Y: usize = 44;

/// A glyph per state, so a state is never told by colour alone.
pub fn glyph(state: &str) -> &'static str {
    match state {
        "pending" => "○",
        "running" => "▶",
        "awaiting_input" => "?",
        "completed" => "✓",
        "failed" => "✗",
        "cancelled" => "⊘",
        _ => "·",
    }
}

/// Each task's layer: 0 for a task without dependencies, else one more than its deepest.
fn layers(tasks: &[TaskRow]) -> Vec<usize> {
    let index: HashMap<&str, usize> = tasks.iter().enumerate().map(|(i, t)| (t.id.as_str(), i)).collect();
    let mut layer = vec![0usize; tasks.len()];
    // Kahn's order: plans are checked acyclic before they are stored.
    let mut waiting: Vec<usize> = tasks.iter().map(|t| t.spec.depends_on.len()).collect();
    let mut below: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    for (i, t) in tasks.iter().enumerate() {
        for d in &t.spec.depends_on {
            match index.get(d.as_str()) {
                Some(&j) => below[j].push(i),
                None => waiting[i] -= 1,
            }
        }
    }
    let mut ready: Vec<usize> = (0..tasks.len()).filter(|&i| waiting[i] == 0).collect();
    while let Some(j) = ready.pop() {
        for &i in &below[j] {
            layer[i] = layer[i].max(layer[j] + 1);
            waiting[i] -= 1;
            if waiting[i] == 0 {
                ready.push(i);
            }
        }
    }
    layer
}

/// Each task's column in its layer: layer by layer from the top, tasks ordered by the mean
/// column of the tasks they depend on (ties in plan order), which keeps a task under its
/// dependencies and uncrosses most edges (the barycenter heuristic, one pass).
fn columns(tasks: &[TaskRow], layer: &[usize]) -> Vec<usize> {
    let index: HashMap<&str, usize> = tasks.iter().enumerate().map(|(i, t)| (t.id.as_str(), i)).collect();
    let depth = layer.iter().copied().max().map_or(0, |d| d + 1);
    let mut by_layer: Vec<Vec<usize>> = vec![Vec::new(); depth];
    for (i, &l) in layer.iter().enumerate() {
        by_layer[l].push(i);
    }
    let mut column = vec![0usize; tasks.len()];
    for members in &mut by_layer {
        let weight = |i: usize| {
            let parents: Vec<usize> =
                tasks[i].spec.depends_on.iter().filter_map(|d| index.get(d.as_str()).copied()).collect();
            if parents.is_empty() {
                return i as f64;
            }
            parents.iter().map(|&j| column[j] as f64).sum::<f64>() / parents.len() as f64
        };
        let mut keyed: Vec<(f64, usize)> = members.iter().map(|&i| (weight(i), i)).collect();
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (c, (_, i)) in keyed.into_iter().enumerate() {
            column[i] = c;
        }
    }
    column
}

/// What a node says under its name: its attempts and the time they ran (to `now_ms` while on).
fn ran(t: &TaskRow, times: Option<&Vec<AttemptTime>>, now_ms: i64) -> String {
    let Some(times) = times.filter(|v| !v.is_empty()) else { return String::new() };
    let n = t.attempt.max(times.len() as i64);
    let ran = super::pages::seconds(AttemptTime::ran_ms(times, now_ms));
    format!("{n} attempt{} · {ran}", if n == 1 { "" } else { "s" })
}

pub fn svg(run: &str, tasks: &[TaskRow], times: &BTreeMap<String, Vec<AttemptTime>>, now_ms: i64) -> Markup {
    let layer = layers(tasks);
    let column = columns(tasks, &layer);
    let mut width_of: Vec<usize> = Vec::new();
    for &l in &layer {
        if width_of.len() <= l {
            width_of.resize(l + 1, 0);
        }
        width_of[l] += 1;
    }
    let cols = width_of.iter().copied().max().unwrap_or(1).max(1);
    let (width, height) = (cols * (W + GAP_X) + GAP_X, width_of.len().max(1) * (H + GAP_Y) + GAP_Y / 2);
    let at = |i: usize| (GAP_X + column[i] * (W + GAP_X), GAP_Y / 2 + layer[i] * (H + GAP_Y));
    let index: HashMap<&str, usize> = tasks.iter().enumerate().map(|(i, t)| (t.id.as_str(), i)).collect();
    html! {
        svg class="graph" role="img" aria-label={ "task graph of run " (run) } viewBox={ "0 0 " (width) " " (height) }
            width=(width) height=(height) xmlns="http://www.w3.org/2000/svg" data-width=(width) {
            defs {
                marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse" {
                    path d="M 0 0 L 10 5 L 0 10 z" {}
                }
            }
            g class="edges" {
                @for (i, t) in tasks.iter().enumerate() {
                    @for d in &t.spec.depends_on {
                        @if let Some(&j) = index.get(d.as_str()) {
                            @let ((x1, y1), (x2, y2)) = (at(j), at(i));
                            @if layer[i] == layer[j] + 1 {
                                // Between adjacent layers an edge stays in the gap between them.
                                line x1=(x1 + W / 2) y1=(y1 + H) x2=(x2 + W / 2) y2=(y2) marker-end="url(#arrow)"
                                    data-from=(tasks[j].id) data-to=(t.id) {}
                            } @else {
                                // Across layers it runs down the gutter left of its task's column,
                                // in the gaps between layers and columns: through no node.
                                @let (top, bottom, gutter) = (y1 + H + GAP_Y / 2, y2 - GAP_Y / 2, x2 - GAP_X / 2);
                                polyline fill="none" marker-end="url(#arrow)" data-from=(tasks[j].id) data-to=(t.id)
                                    points={ (x1 + W / 2) "," (y1 + H) " " (x1 + W / 2) "," (top) " " (gutter) "," (top) " "
                                        (gutter) "," (bottom) " " (x2 + W / 2) "," (bottom) " " (x2 + W / 2) "," (y2) } {}
                            }
                        }
                    }
                }
            }
            @for (i, t) in tasks.iter().enumerate() {
                @let (x, y) = at(i);
                @let state = t.state.as_str();
                a href={ "/ui/runs/" (super::pages::seg(run)) "/tasks/" (super::pages::seg(&t.id)) } {
                    g class={ "node state-" (state) } data-task=(t.id) data-state=(state) transform={ "translate(" (x) "," (y) ")" } {
                        title { (t.id) ": " (state) }
                        rect width=(W) height=(H) rx="6" {}
                        text x="10" y="19" { (glyph(state)) " " (short(&t.id)) }
                        @let ran = ran(t, times.get(&t.id), now_ms);
                        @if !ran.is_empty() { text class="meta" x="10" y="35" { (ran) } }
                    }
                }
            }
        }
    }
}

fn short(id: &str) -> String {
    if id.chars().count() <= 18 { id.to_owned() } else { format!("{}…", id.chars().take(17).collect::<String>()) }
}
