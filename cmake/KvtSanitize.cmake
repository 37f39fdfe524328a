# KVT_SANITIZE: build the host C++ code and every link with Clang's or GCC's sanitizers.
#   -DKVT_SANITIZE=address,undefined   AddressSanitizer + UndefinedBehaviorSanitizer
#   -DKVT_SANITIZE=thread              ThreadSanitizer
# tools/ci/sanitize.sh configures both and runs the tests under them. Device code is left
# uninstrumented: nvcc hands host code to its own host compiler (g++ unless told otherwise), and
# -Xcompiler=-fsanitize=... there would link GCC's sanitizer runtime beside Clang's, which do not
# coexist in one process. The .cu files hold kernels and their launch stubs, whose host side only
# packs arguments; the pool, engine and backends that call them are instrumented.
set(KVT_SANITIZE "" CACHE STRING
  "Sanitizers for host code and links: address,undefined or thread (empty: none)")
if(KVT_SANITIZE)
  string(REPLACE "," ";" kvt_sanitizers "${KVT_SANITIZE}")
  foreach(s IN LISTS kvt_sanitizers)
    if(NOT s MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "KVT_SANITIZE=${KVT_SANITIZE}: '${s}' is not one of address, undefined, "
                          "thread, leak (e.g. -DKVT_SANITIZE=address,undefined or thread)")
    endif()
  endforeach()
  if("thread" IN_LIST kvt_sanitizers AND ("address" IN_LIST kvt_sanitizers OR
                                          "leak" IN_LIST kvt_sanitizers))
    message(FATAL_ERROR "KVT_SANITIZE=${KVT_SANITIZE}: ThreadSanitizer cannot be combined with "
                        "AddressSanitizer or LeakSanitizer; configure a separate build folder")
  endif()
  set(kvt_sanitize_flags -fsanitize=${KVT_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST kvt_sanitizers)
    # A finding stops the program (and fails its test) instead of printing and going on.
    list(APPEND kvt_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${kvt_sanitize_flags}>")
  add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-fsanitize=${KVT_SANITIZE}>")
endif()
