#!/usr/bin/env python3
"""Checks that a crate's modules import one way: builds the graph of `crate::` paths in non-test
code (each file up to its `#[cfg(test)]` module; modules declared `#[cfg(test)] mod name;` are
test support, left out) and prints any cycle, between files and between top-level modules. Exit 1 on a cycle. Usage: scripts/check-import-layers.py CRATE_SRC_DIR..."""
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

bad = False
for src in sys.argv[1:]:
    g = edges(modules(src))
    top = {}
    for m, ts in g.items():
        for t in ts:
            a, b = m.split("::")[0], t.split("::")[0]
            if a != b:
                top.setdefault(a, set()).add(b)
    for name, graph in (("files", g), ("top-level modules", top)):
        for c in cycles(graph):
            bad = True
            print(f"{src}: import cycle between {name}: {' -> '.join(c)}")
sys.exit(1 if bad else 0)
