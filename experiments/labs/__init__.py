"""Labs: offline-built candidate kernels that are not (yet) part of the product, with their instruction counts.

- `kernels`: tensor-core NF4 GEMV candidates whose decode moves the level lookup off the integer (ALU) pipe
  (a 256-entry level-pair table or a 16-entry level table in shared memory, addressed with IMAD.HI or PRMT). The
  pair table with 16 copies is also a product kernel, in no tuned row: nf4/linear/gemv_pair.py (kernel
  "gemv_pair"), its asm checked by `models` and its build counted by `sass_count` (builds gemv_pair*).
- `models`: NumPy models of each candidate's decode (which element of W meets which element of x) and a small
  vectorised PTX emulator that runs the candidates' own inline asm.
- `sass_count`: compiles a kernel offline for sm_90 and counts the SASS of its main loop by pipe per weight.
- `gemv_lut`: the GPU entry point (operand check and CUDA-graph timing against nf4.linear and dense cuBLAS).
"""
