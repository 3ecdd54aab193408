"""The stages of a load, one module each: parse, index, plan, allocate, read, upload,
validate."""
