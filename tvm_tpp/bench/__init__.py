"""The benchmark harness behind ``tvm-tpp bench``, ``bench-gemm`` and ``bench-kernel``.

Modules, from the front ends down:

- :mod:`~tvm_tpp.bench.networks` — ``bench``: whole models against TVM, MetaSchedule and
  ONNX Runtime; :mod:`~tvm_tpp.bench.gemm` — ``bench-gemm``: fp32 GEMM GFLOPS;
  :mod:`~tvm_tpp.bench.kernel` — ``bench-kernel``: one BRGEMM micro-kernel against the peak;
- :mod:`~tvm_tpp.bench.report`, :mod:`~tvm_tpp.bench.plots` — tables, JSON, the tuner's
  explanation (also ``tune --explain``) and charts; :mod:`~tvm_tpp.bench.progress` — the
  progress bar;
- :mod:`~tvm_tpp.bench.protocol` — the jobs and JSON-lines protocol between a harness and
  its workers (``python -m tvm_tpp.bench JOB``); :mod:`~tvm_tpp.bench.workers` — the worker
  processes;
- :mod:`~tvm_tpp.bench.impls` — how each implementation is built, and the one rule for
  tuning time; :mod:`~tvm_tpp.bench.metaschedule` — MetaSchedule's database reuse;
  :mod:`~tvm_tpp.bench.workloads` — what is computed and how it is checked;
- :mod:`~tvm_tpp.bench.timing` — the one timer and sampling policy.

Importing the package loads none of them (the CLI stays fast to start).
"""
