"""The frontend: everything between a user's call and the engine core's ``EngineCoreRequest`` /
``RequestOutput``, shared by both doors (docs/architecture.md, "Two doors, one hallway").

- ``input_processor``: prompt kinds -> ids (+ media leased in shared memory), sampling defaults,
  the context-window and capacity rules, ``EngineCoreRequest``s (n > 1 fan-out);
- ``tokenizer_pool``: the input processor's id-making half in worker processes (the server);
- ``request_tracker``, ``output_processor``, ``detokenizer``, ``parallel_sampling``: from the
  core's outputs back to ``RequestOutput``s, stop strings, leases;
- ``llm`` (the offline ``LLM``, one process) and ``async_llm`` (``AsyncLLM``, the server's);
- ``errors``: how a request is refused, with the status both doors report.
"""
