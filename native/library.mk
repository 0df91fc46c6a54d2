# What every native library's Makefile shares (included after its own CFLAGS):
#   make BUILD=build-asan SAN=address   a sanitizer build in its own directory
.DEFAULT_GOAL := all

# Without SAN, a shared library must link with every symbol resolved (--no-undefined).
ifneq ($(SAN),)
override CFLAGS += -fsanitize=$(SAN) -fno-omit-frame-pointer
override LDFLAGS += -fsanitize=$(SAN)
else
override LDFLAGS += -Wl,--no-undefined
endif

$(BUILD):
	mkdir -p $@

clean:
	rm -rf build build-*
