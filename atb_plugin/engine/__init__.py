"""The engine: requests, KV block management with prefix caching, input batch and
prepare_inputs, scheduler, sampler, model runner, engine core, and the offline ``LLM`` API."""
