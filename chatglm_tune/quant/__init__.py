"""INT8/INT4 weights: the official format (`format`), the layers holding them (`modules`), their
matmul kernels (`kernels`, `int4_cpu`, `cpu_matmul`), and putting them into a model (`apply`)."""
