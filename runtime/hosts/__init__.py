"""Hosts: what moves streamed weights between devices. ComfyUI's core, or our standalone one."""
