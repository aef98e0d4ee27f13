# Instrumented builds of the host code. Device code (nvcc) is never instrumented; host code that
# nvcc compiles stays plain too, and links against the instrumented rest.
#
#   EPX_SANITIZE="address,undefined"  every C++ object and link of this build (scripts/sanitize.sh
#                                     runs the CPU tests so; g++ or clang)
#   EPX_BUILD_FUZZERS=ON              clang only: the libFuzzer targets of tests/fuzz, with the
#                                     host libraries built for coverage, ASan and UBSan
#                                     (scripts/fuzz.sh)
#
# Undefined behaviour stops the process (no recovery), so a finding fails its test or fuzzer.

set(epx_sanitizers "${EPX_SANITIZE}")
if(EPX_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "EPX_BUILD_FUZZERS needs clang (libFuzzer), this build uses "
                        "${CMAKE_CXX_COMPILER_ID}: configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(NOT epx_sanitizers)
    set(epx_sanitizers "address,undefined")
  endif()
  # Coverage feedback for every host object; the fuzz targets link libFuzzer's main.
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>)
endif()

if(epx_sanitizers)
  message(STATUS "epx: host code built with -fsanitize=${epx_sanitizers}")
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${epx_sanitizers}>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=all>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>)
  add_link_options($<$<LINK_LANGUAGE:CXX>:-fsanitize=${epx_sanitizers}>)
endif()
