"""One request through ``target.generate(assistant_model=drafter)``: drafting, candidate generators, the hook."""
