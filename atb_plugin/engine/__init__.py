"""The engine core and its boundary: requests, KV block management with prefix caching, input
batch and prepare_inputs, scheduler, sampler, model runner, ``EngineCore``, the start-up memory
profile, the engine-core process and the clients a frontend drives it with (``client``). Ids in,
ids out: no tokenizer, no routers, no ``ShmStore`` (the frontend's, ``atb_plugin.frontend``)."""
