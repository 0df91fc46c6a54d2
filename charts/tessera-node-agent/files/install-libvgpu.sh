#!/bin/sh
# Installs libvgpu on the host for the node agent to mount into GPU containers.
#
# Running containers map the library that was current when they started, so it must never be
# rewritten in place (truncating a mapped file kills them with SIGBUS). Each build goes to its
# own file named after its content hash; the stable name libvgpu.so is a symlink switched with
# rename(2), which is atomic and leaves the old file for whoever still maps it. The preload file
# is replaced the same way, and only when its content changes.
#
# Environment: LIBVGPU_SOURCE (the library in the image), VGPU_DIR (the host directory),
# LIBVGPU_CONTAINER_PATH (where containers see libvgpu.so).
set -eu

source_lib="${LIBVGPU_SOURCE:?LIBVGPU_SOURCE is not set}"
vgpu_dir="${VGPU_DIR:?VGPU_DIR is not set}"
container_path="${LIBVGPU_CONTAINER_PATH:?LIBVGPU_CONTAINER_PATH is not set}"

if [ ! -f "$source_lib" ]; then
    echo "install-libvgpu: $source_lib not found in the image" >&2
    exit 1
fi
if [ -d "$vgpu_dir/libvgpu.so" ] && [ ! -L "$vgpu_dir/libvgpu.so" ]; then
    echo "install-libvgpu: $vgpu_dir/libvgpu.so is a directory" >&2
    exit 1
fi
mkdir -p "$vgpu_dir"

digest=$(sha256sum "$source_lib" | cut -c1-16)
versioned="libvgpu.so.$digest"
if [ ! -f "$vgpu_dir/$versioned" ]; then
    cp "$source_lib" "$vgpu_dir/.$versioned.tmp"
    chmod 0755 "$vgpu_dir/.$versioned.tmp"
    mv -f "$vgpu_dir/.$versioned.tmp" "$vgpu_dir/$versioned"
fi

ln -sfn "$versioned" "$vgpu_dir/.libvgpu.so.tmp"
mv -f "$vgpu_dir/.libvgpu.so.tmp" "$vgpu_dir/libvgpu.so"

preload="$container_path"
if [ ! -f "$vgpu_dir/ld.so.preload" ] || [ "$(cat "$vgpu_dir/ld.so.preload")" != "$preload" ]; then
    printf '%s\n' "$preload" > "$vgpu_dir/.ld.so.preload.tmp"
    chmod 0644 "$vgpu_dir/.ld.so.preload.tmp"
    mv -f "$vgpu_dir/.ld.so.preload.tmp" "$vgpu_dir/ld.so.preload"
fi

echo "install-libvgpu: $vgpu_dir/libvgpu.so -> $versioned"
