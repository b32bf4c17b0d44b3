# `cmake --install build --prefix P`: the library (shared, with a versioned
# soname, and static), its public headers under P/include/shardplane/, a
# pkg-config file, a CMake package (find_package(shardplane) ->
# shardplane::shardplane, shardplane::shardplane_static) and the programs.
include(CMakePackageConfigHelpers)

# The public headers, as the installed tree has them: shardplane.h and the
# common/ headers it includes, with their quoted folder-qualified includes
# ("plan/plan.h") turned into <shardplane/plan/plan.h>, so an installed
# header pulls in only installed headers and no bare "plan.h" can collide
# with another project's.
set(SP_PUBLIC_HEADERS client/lib/shardplane.h common/base/sp_error.h
    common/cast/dtype.h common/plan/job.h common/plan/model.h
    common/plan/plan.h common/plan/state.h common/plan/memory.h)
set(SP_STAGED ${SP_STAGED_INCLUDE}/shardplane)
foreach(h ${SP_PUBLIC_HEADERS})
  file(READ ${PROJECT_SOURCE_DIR}/${h} text)
  string(REGEX REPLACE "#include \"(base|cast|plan|shardplane)/([a-z_]+\\.h)\""
         "#include <shardplane/\\1/\\2>" text "${text}")
  string(REPLACE "<shardplane/shardplane/" "<shardplane/" text "${text}")
  string(REGEX REPLACE "^(client/lib|common)/" "" rel ${h})
  file(WRITE ${SP_STAGED}/${rel}.tmp "${text}")
  configure_file(${SP_STAGED}/${rel}.tmp ${SP_STAGED}/${rel} COPYONLY)
  file(REMOVE ${SP_STAGED}/${rel}.tmp)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
               ${PROJECT_SOURCE_DIR}/${h})
  get_filename_component(dir ${rel} DIRECTORY)
  install(FILES ${SP_STAGED}/${rel}
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardplane/${dir}
          COMPONENT dev)
endforeach()
install(FILES ${SP_GEN_INCLUDE}/shardplane/config.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/shardplane COMPONENT dev)

install(TARGETS shardplane_shared shardplane_static EXPORT shardplaneTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS shardplane shardplane-worker shardplane-coordinator
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# the worker's GPU models, which it loads from <libdir>/shardplane/ beside
# <bindir> (client/worker/CMakeLists.txt)
if(SHARDPLANE_HAVE_CUDA)
  install(TARGETS shardplane-worker-cuda
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/shardplane)
endif()

set(SP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/shardplane)
install(EXPORT shardplaneTargets NAMESPACE shardplane::
        DESTINATION ${SP_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/shardplaneConfig.cmake.in
  ${PROJECT_BINARY_DIR}/shardplaneConfig.cmake INSTALL_DESTINATION ${SP_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/shardplaneConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/shardplaneConfig.cmake
        ${PROJECT_BINARY_DIR}/shardplaneConfigVersion.cmake
        DESTINATION ${SP_CMAKE_DIR})

# pkg-config: Libs.private / Requires.private are what a static link needs.
set(SP_PC_LIBS_PRIVATE "-lgloo -lstdc++ -lpthread -lm")
if(SHARDPLANE_HAVE_CUDA)
  string(APPEND SP_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
if(SHARDPLANE_HAVE_NCCL)
  get_filename_component(SP_NCCL_DIR ${NCCL_LIBRARY} DIRECTORY)
  string(APPEND SP_PC_LIBS_PRIVATE " -L${SP_NCCL_DIR} -lnccl")
endif()
# The prefix relative to the .pc file, so the install can be moved (and
# `cmake --install --prefix P` works without reconfiguring).
file(RELATIVE_PATH SP_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${PROJECT_SOURCE_DIR}/cmake/shardplane.pc.in
               ${PROJECT_BINARY_DIR}/shardplane.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/shardplane.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
