"""Weight quantizers: pure array functions (quantize, dequantize) per scheme, plus AWQ and the accuracy report."""
