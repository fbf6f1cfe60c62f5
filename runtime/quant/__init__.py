"""Quantized residents: weights held in a compact storage dtype and dequantized on the compute device."""
