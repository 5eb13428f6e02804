"""Developer tooling: the `./run` and `./test` orchestration (`tools.devservices`)."""
