"""Tensor parallelism: process groups (`group`), the executors that run each step on every
rank (`executor`, `ray`), and the worker process's entry point (`worker`)."""
