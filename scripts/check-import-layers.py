#!/usr/bin/env python3
"""Checks that a crate's modules import one way: builds the graph of `crate::` paths in non-test
code (each file up to its `#[cfg(test)]` module; modules declared `#[cfg(test)] mod name;` are
test support, left out) and prints any cycle, between files and between top-level modules. Where
the crate's lib.rs states its layers ("imports point down this list", then one `- `a`, `b`: ...`
bullet per layer, lowest first), an import from a module to one in a later layer (upward) is an
error too, and so is a top-level module the list does not place. Exit 1 on any error. Usage:
scripts/check-import-layers.py CRATE_SRC_DIR..."""
import os, re, sys

# A module declared for tests only (`#[cfg(test)] mod name;`): test support, not a layer.
TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")

def modules(src):
    out, test_only = {}, set()
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if rel and rel[0] == "bin":
                continue
            text = open(path).read()
            test_only.update("::".join(rel + [name]) for name in TEST_MODULE.findall(text))
            text = TEST_MODULE.sub("", text).split("#[cfg(test)]")[0]
            text = re.sub(r"//[^\n]*", "", text)  # comments and doc links are not imports
            out["::".join(rel)] = text
    return {m: text for m, text in out.items() if m not in test_only}

def edges(mods):
    graph = {m: set() for m in mods}
    for m, text in mods.items():
        for hit in re.finditer(r"\bcrate::((?:\w+::)*\w+)", text):
            parts = hit.group(1).split("::")
            # the longest prefix that is a module
            for n in range(len(parts), 0, -1):
                target = "::".join(parts[:n])
                if target in mods:
                    break
            else:
                continue
            if target != m and not m.startswith(target + "::") and target:
                graph[m].add(target)
        for hit in re.finditer(r"use crate::\{([^}]*)\}", text):
            for name in re.findall(r"\b(\w+)\b", hit.group(1)):
                if name in mods and name != m:
                    graph[m].add(name)
    return graph

def cycles(graph):
    found, state, stack = [], {}, []
    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph.get(n, ())):
            if state.get(t) == 1:
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = 2
    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found

def layers(src):
    """The layer of each top-level module lib.rs's doc list names, or None where it states none."""
    lib = os.path.join(src, "lib.rs")
    if not os.path.exists(lib):
        return None
    doc = [l[4:].rstrip() for l in open(lib).read().splitlines() if l.startswith("//!")]
    starts = [i for i, l in enumerate(doc) if "imports point down this list" in l]
    if not starts:
        return None
    layer_of, layer = {}, 0
    for line in doc[starts[0] + 1:]:
        bullet = re.match(r"- ((?:`\w+`(?:, )?)+):", line)
        if bullet:
            # The names of one bullet share its layer.
            for name in re.findall(r"`(\w+)`", bullet.group(1)):
                layer_of[name] = layer
            layer += 1
        elif layer_of and line and not line.startswith(" "):
            break  # the list's end: a line that is neither a bullet nor its continuation
    return layer_of

def problems(src):
    """What is wrong with the imports of the crate at `src`, one line each."""
    out = []
    g = edges(modules(src))
    order = layers(src)
    if order is not None:
        for top_m in sorted({m.split("::")[0] for m in g} - set(order) - {""}):
            out.append(f"{src}: module {top_m} is in no layer of lib.rs's list: add it where it belongs")
        for m in sorted(g):
            top_m = m.split("::")[0]
            for t in sorted(g[m]):
                top_t = t.split("::")[0]
                if top_m in order and top_t in order and order[top_t] > order[top_m]:
                    out.append(f"{src}: upward import: {m} (layer {order[top_m]}) uses {t} (layer {order[top_t]}), a later, higher layer in lib.rs's list")
    top = {}
    for m, ts in g.items():
        for t in ts:
            a, b = m.split("::")[0], t.split("::")[0]
            if a != b:
                top.setdefault(a, set()).add(b)
    for name, graph in (("files", g), ("top-level modules", top)):
        for c in cycles(graph):
            out.append(f"{src}: import cycle between {name}: {' -> '.join(c)}")
    return out

def self_test():
    """The check on made-up crates: an upward import and a module the list does not place are
    found, a downward import is not."""
    import tempfile
    lib = "//! Layers; imports point down this list:\n//!\n//! - `low`, `base`: the bottom;\n//! - `high`: above it,\n//!   a continued line.\n//!\n//! Not a layer: `other`.\n\n"
    def crate(files):
        src = tempfile.mkdtemp()
        for name, text in files.items():
            open(os.path.join(src, name), "w").write(text)
        return src
    fine = crate({"lib.rs": lib, "low.rs": "pub fn f() { crate::base::g() }\n", "base.rs": "pub fn g() {}\n", "high.rs": "pub fn h() { crate::low::f() }\n"})
    assert layers(fine) == {"low": 0, "base": 0, "high": 1}, layers(fine)
    assert problems(fine) == [], problems(fine)
    upward = crate({"lib.rs": lib, "low.rs": "use crate::high::h;\npub fn f() { h() }\n", "high.rs": "pub fn h() {}\n", "extra.rs": "\n"})
    found = problems(upward)
    assert any("upward import: low (layer 0) uses high (layer 1)" in p for p in found), found
    assert any("module extra is in no layer" in p for p in found), found

if sys.argv[1:] == ["--self-test"]:
    self_test()
    print("check-import-layers: self-test passed")
    sys.exit(0)
found = [p for src in sys.argv[1:] for p in problems(src)]
for p in found:
    print(p)
sys.exit(1 if found else 0)
