# ctest epx_install_consumer: installs the build tree BUILD into WORK/prefix, then configures,
# builds and runs the project in SRC against it (find_package(epx), epx::epx_moe).
file(REMOVE_RECURSE "${WORK}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run("${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${WORK}/prefix")
run("${CMAKE_COMMAND}" -S "${SRC}" -B "${WORK}/build" "-DCMAKE_PREFIX_PATH=${WORK}/prefix"
    "-DCMAKE_CXX_COMPILER=${CXX}" "-DCUDAToolkit_ROOT=${CUDA_ROOT}" -DCMAKE_BUILD_TYPE=Release)
run("${CMAKE_COMMAND}" --build "${WORK}/build")
run("${WORK}/build/epx_install_consumer")
