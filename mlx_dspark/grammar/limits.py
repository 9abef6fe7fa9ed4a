"""What a grammar may cost, checked before llguidance sees it, and where llguidance runs
(docs/grammar.md, "Limits").

llguidance compiles a JSON schema by recursion on the C stack: each level of the schema, and
each level behind a ``$ref`` it follows, takes a few kilobytes, so a schema whose references
chain a thousand levels deep overflows an 8 MiB stack and kills the process (SIGSEGV: nothing
to catch). Its time and memory grow with the grammar's size. So, before it runs:

* a grammar's text is at most :data:`MAX_GRAMMAR_BYTES`; a JSON schema nests at most
  :data:`MAX_SCHEMA_DEPTH` levels as written and :data:`MAX_RESOLVED_DEPTH` with its ``$ref``s
  followed; forced tool calls have at most :data:`MAX_TOOL_PARAMETERS` parameters in all;

and while it runs (:func:`compiled`):

* on a thread of its own whose stack (:data:`STACK_BYTES`) holds more recursion than any text
  within the size limit can cause (the ``$ref`` bound is the clear message, the stack the
  guarantee), at most :data:`COMPILERS` at once, for at most :data:`COMPILE_SECONDS`, under
  :func:`parser_limits`: llguidance's own bounds on lexer states and grammar symbols, the
  memory a matcher may hold."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import threading
from urllib.parse import unquote

from ..request import RequestError

MAX_GRAMMAR_BYTES = 256 << 10
MAX_SCHEMA_DEPTH = 32           # arrays and objects, as the server's request bodies
MAX_RESOLVED_DEPTH = 256        # the same, with every '$ref' followed
MAX_TOOL_PARAMETERS = 1000      # of the functions a forced tool call may call, in all
COMPILE_SECONDS = 10.0
COMPILERS = 2
# Measured: at most ~240 bytes of stack per byte of grammar text (a '$ref' chain of
# 'prefixItems'), so 256 KiB of text needs at most ~60 MiB; a thread's stack is reserved
# address space, and only the pages it touches take memory.
STACK_BYTES = 256 << 20


@functools.cache
def parser_limits():
    """llguidance's limits for every matcher: its defaults, but lexer states (each costs 1-2
    kB, so 100,000 of them bound a matcher near 200 MB), and errors without the parser's
    state and the whole grammar appended (the message alone says what went wrong)."""
    import llguidance
    return llguidance.LLParserLimits(max_lexer_states=100_000, max_grammar_size=500_000,
                                     verbose_errors=False)


class GrammarBusy(RuntimeError):
    """Every compiler stayed busy for COMPILE_SECONDS: the server's state, not the request's
    (a 503)."""


def check_size(source: str, label: str, param: str):
    size = len(source.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise RequestError(param, f"{label}: {size} bytes, more than the limit of "
                                  f"{MAX_GRAMMAR_BYTES}")


def check_schema(schema, label: str, param: str):
    """Refuse a JSON schema that nests deeper than the limits, as written or with its
    ``$ref``s followed."""
    edges, depth, refs = _graph(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(param, f"{label}: the schema nests {depth} levels deep, more than "
                                  f"the limit of {MAX_SCHEMA_DEPTH}")
    resolved = _deepest(edges) if refs else depth
    if resolved > MAX_RESOLVED_DEPTH:
        raise RequestError(param, f"{label}: with its $refs followed the schema nests "
                                  f"{resolved} levels deep, more than the limit of "
                                  f"{MAX_RESOLVED_DEPTH}")


def _graph(schema) -> tuple[list[list[int]], int, int]:
    """The arrays and objects of ``schema`` as a graph, node 0 the schema itself: the edges
    from each to its members and, for an object whose ``$ref`` names a place in this document
    (``#/...``), to that place; how deep they nest as written; how many such ``$ref``s."""
    nodes, index, depths = [schema], {id(schema): 0}, [1]
    edges: list[list[int]] = [[]]
    for i, node in enumerate(nodes):          # breadth first: the list grows as it is read
        for value in node.values() if isinstance(node, dict) else node:
            if not isinstance(value, (dict, list)):
                continue
            if id(value) not in index:
                index[id(value)] = len(nodes)
                nodes.append(value)
                depths.append(depths[i] + 1)
                edges.append([])
            edges[i].append(index[id(value)])
    refs = 0
    for i, node in enumerate(nodes):
        ref = node.get("$ref") if isinstance(node, dict) else None
        target = _pointed(schema, ref) if isinstance(ref, str) else None
        if target is not None:
            edges[i].append(index[id(target)])
            refs += 1
    return edges, max(depths), refs


def _pointed(schema, ref: str):
    """The array or object that a ``$ref`` of the form ``#`` or ``#/a/b`` names in
    ``schema`` (a JSON pointer, RFC 6901), or None (another document, an anchor, nothing)."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return None
    at = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(at, dict):
            at = at.get(part)
        elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
            at = at[int(part)]
        else:
            return None
    return at if isinstance(at, (dict, list)) else None


def _deepest(edges: list[list[int]]) -> int:
    """The most nodes on a path from node 0, a group of nodes that reach each other (a
    ``$ref`` cycle) counted whole: a bound on any recursion that enters a node at most once
    per path, whatever order it takes. Tarjan's strongly connected components, iteratively
    (no Python recursion to exhaust); each group is closed after every group it reaches, so
    its depth is its size plus the deepest of those."""
    order, low, group = [-1] * len(edges), [0] * len(edges), [-1] * len(edges)
    group_depth: list[int] = []
    stack, on_stack, work = [], [False] * len(edges), []
    entered = itertools.count()

    def enter(v: int):
        order[v] = low[v] = next(entered)
        stack.append(v)
        on_stack[v] = True
        work.append((v, 0))

    enter(0)
    while work:
        v, k = work[-1]
        if k < len(edges[v]):
            work[-1] = (v, k + 1)
            w = edges[v][k]
            if order[w] < 0:
                enter(w)
            elif on_stack[w]:
                low[v] = min(low[v], order[w])
            continue
        work.pop()
        if work:
            low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == order[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
                on_stack[members[-1]] = False
                group[members[-1]] = len(group_depth)
            below = max((group_depth[group[w]] for m in members for w in edges[m]
                         if group[w] != len(group_depth)), default=0)
            group_depth.append(len(members) + below)
    return group_depth[group[0]]


def compiled(work, *args, label: str, param: str):
    """``work(*args)`` (llguidance's compilation) on a thread with :data:`STACK_BYTES` of
    stack, at most :data:`COMPILERS` at once; a RequestError when it takes longer than
    :data:`COMPILE_SECONDS` (the thread cannot be stopped: it finishes on its own, holding
    its place until then), :class:`GrammarBusy` when no place frees within that time."""
    places = _places
    if not places.acquire(timeout=COMPILE_SECONDS):
        raise GrammarBusy(f"every grammar compiler stayed busy for {COMPILE_SECONDS:g} s; "
                          f"retry later")
    result = concurrent.futures.Future()

    def run():
        try:
            result.set_result(work(*args))
        except BaseException as e:       # handed to the caller, who raises it
            result.set_exception(e)
        finally:
            places.release()

    try:
        _start(run)
    except BaseException:
        places.release()
        raise
    try:
        return result.result(timeout=COMPILE_SECONDS)
    except concurrent.futures.TimeoutError:
        raise RequestError(param, f"{label}: compiling the grammar took longer than the "
                                  f"limit of {COMPILE_SECONDS:g} s") from None


_places = threading.BoundedSemaphore(COMPILERS)
_stack_size = threading.Lock()


def _start(run):
    # threading.stack_size applies to threads started after it is set, by anyone: set it,
    # start, and put it back under one lock (no other code here sets it).
    with _stack_size:
        before = threading.stack_size(STACK_BYTES)
        try:
            threading.Thread(target=run, name="mlx-dspark-grammar", daemon=True).start()
        finally:
            threading.stack_size(before)
