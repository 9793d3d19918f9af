"""The pure rules core: expressions, step series, rule files, the engine, the planner, pricing.

Data in, data out: the engine is a function (rules, window, state, step) -> (decisions, new
state); the planner turns a decision into journal entries and values; pricing says what an
action costs and when a tuning relaunch may go. The live controller, ``watchdog replay``,
``watchdog eval`` and the rule unit tests all run this same code. It imports the protocol
(catalog, layout constants) and nothing that does I/O: no sources, control, backends,
observe or cli module, no sqlite3, subprocess or sockets (an import-linter contract).
"""
